"""The job store's wire format: a request and a reply as ZeroMQ frames (no zmq, no torch).

The job's rendezvous store (:mod:`~torchpass_slurm.control.store_server`) speaks
over the control plane's CURVE keys, so every frame below is already
encrypted and authenticated by the time it is parsed; the parser still
refuses anything malformed with a :class:`WireError`, never a crash, and
nothing is ever unpickled. A request is::

    [request id (8 bytes), op (1 byte), arguments...]

and its reply::

    [request id, status, payload...]      status: b"ok" | b"timeout" | b"error"

The operations are those of torch's ``Store`` that torch.distributed and this
project use (gloo's rendezvous needs set, get and wait):

==  ==============================  ====================================
op  arguments                       reply payload
==  ==============================  ====================================
S   key, value                      (none)
G   key, timeout ms                 value (waits until the key is set)
A   key, delta (decimal)            the new value (decimal)
W   timeout ms, key, key...         (none; waits until every key is set)
C   key, key...                     b"1" when every key is set, else b"0"
X   key, expected, desired          the value now stored
D   key                             b"1" when the key existed, else b"0"
N   (none)                          the number of keys (decimal)
==  ==============================  ====================================
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "Op",
    "Request",
    "WireError",
    "OK",
    "TIMEOUT",
    "ERROR",
    "MAX_KEY_BYTES",
    "MAX_VALUE_BYTES",
    "MAX_KEYS_PER_REQUEST",
    "parse_request",
    "encode_int",
    "parse_int",
]

OK, TIMEOUT, ERROR = b"ok", b"timeout", b"error"
#: A key longer than this is refused (torch's keys are short: "epoch3/default_pg/0/rank_1").
MAX_KEY_BYTES = 1024
#: A value larger than this is refused (gloo's addresses are a few hundred bytes).
MAX_VALUE_BYTES = 16 << 20
#: Most keys one wait or check may name.
MAX_KEYS_PER_REQUEST = 65_536
_ID_BYTES = 8
_MAX_INT_DIGITS = 20


class WireError(ValueError):
    """A request that does not follow the wire format (its text says how)."""


class Op(enum.Enum):
    SET = b"S"
    GET = b"G"
    ADD = b"A"
    WAIT = b"W"
    CHECK = b"C"
    COMPARE_SET = b"X"
    DELETE = b"D"
    NUM_KEYS = b"N"


#: How many argument frames each op takes (None: one or more keys after its fixed ones).
_ARITY: dict[Op, int | None] = {
    Op.SET: 2,
    Op.GET: 2,
    Op.ADD: 2,
    Op.WAIT: None,
    Op.CHECK: None,
    Op.COMPARE_SET: 3,
    Op.DELETE: 1,
    Op.NUM_KEYS: 0,
}


@dataclass(frozen=True)
class Request:
    """One parsed request: its id (echoed in the reply), op, keys and the op's other arguments."""

    request_id: bytes
    op: Op
    keys: tuple[bytes, ...] = ()
    value: bytes = b""
    expected: bytes = b""
    number: int = 0  # ADD's delta, or GET's and WAIT's timeout in ms


def parse_request(frames: list[bytes]) -> Request:
    """The request in ``frames`` (after the routing id); WireError if it is malformed."""
    if len(frames) < 2 or len(frames[0]) != _ID_BYTES:
        raise WireError(f"a request is [8-byte id, op, arguments...]; got {len(frames)} frame(s)")
    request_id, raw_op, args = frames[0], frames[1], frames[2:]
    try:
        op = Op(raw_op)
    except ValueError:
        raise WireError(f"unknown op {raw_op[:8]!r}") from None
    arity = _ARITY[op]
    if arity is None:
        fixed = 1 if op is Op.WAIT else 0
        if not fixed < len(args) <= fixed + MAX_KEYS_PER_REQUEST:
            raise WireError(f"{op.name} takes {fixed} argument(s) and 1 to {MAX_KEYS_PER_REQUEST} keys")
    elif len(args) != arity:
        raise WireError(f"{op.name} takes {arity} argument(s), got {len(args)}")
    if op is Op.WAIT:
        keys = tuple(_key(k) for k in args[1:])
        return Request(request_id, op, keys, number=parse_int(args[0], minimum=0))
    if op is Op.CHECK:
        return Request(request_id, op, tuple(_key(k) for k in args))
    if op is Op.NUM_KEYS:
        return Request(request_id, op)
    key = (_key(args[0]),)
    if op is Op.SET:
        return Request(request_id, op, key, value=_value(args[1]))
    if op is Op.GET:
        return Request(request_id, op, key, number=parse_int(args[1], minimum=0))
    if op is Op.ADD:
        return Request(request_id, op, key, number=parse_int(args[1]))
    if op is Op.COMPARE_SET:
        return Request(request_id, op, key, value=_value(args[2]), expected=_value(args[1]))
    return Request(request_id, op, key)  # DELETE


def encode_int(value: int) -> bytes:
    return str(value).encode("ascii")


def parse_int(raw: bytes, minimum: int | None = None) -> int:
    """A decimal integer of at most 20 digits; WireError otherwise."""
    text = raw.decode("ascii", errors="replace")
    digits = text[1:] if text[:1] == "-" else text
    if not (digits.isdigit() and digits.isascii() and len(digits) <= _MAX_INT_DIGITS):
        raise WireError(f"not a decimal integer: {raw[:24]!r}")
    value = int(text)
    if minimum is not None and value < minimum:
        raise WireError(f"{value} is below {minimum}")
    return value


def _key(raw: bytes) -> bytes:
    if not 0 < len(raw) <= MAX_KEY_BYTES:
        raise WireError(f"a key has 1 to {MAX_KEY_BYTES} bytes, got {len(raw)}")
    return raw


def _value(raw: bytes) -> bytes:
    if len(raw) > MAX_VALUE_BYTES:
        raise WireError(f"a value has at most {MAX_VALUE_BYTES} bytes, got {len(raw)}")
    return raw
