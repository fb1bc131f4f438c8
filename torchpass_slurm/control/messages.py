"""Control-plane messages: kinds, bodies, and their authenticated wire form.

A message travels as three ZeroMQ frames (inside a CURVE-encrypted connection,
:mod:`~torchpass_slurm.control.security`)::

    frame 0  b"tp3"                       protocol version
    frame 1  canonical JSON of {body, kind, sender, seq, to, ts}
    frame 2  HMAC-SHA256(secret, DOMAIN + frame 0 + b"\\0" + frame 1)   (32 raw bytes)

"Canonical" means ``json.dumps(..., sort_keys=True, separators=(",", ":"),
ensure_ascii=True, allow_nan=False)``: one object, one byte string. The
receiver checks the MAC over the bytes it received *before* it parses them, so
an unauthenticated peer never gets its bytes interpreted beyond their length.
Nothing is ever unpickled.

:func:`decode` rejects, in this order:

=====================================  ==========================  ==========================
what                                   raised                      why
=====================================  ==========================  ==========================
wrong frame count / version / sizes    ControlPlaneError           malformed
MAC does not verify                    AuthenticationError         forged or wrong secret
not JSON / wrong field types           ControlPlaneError           malformed (but authentic)
nested too deep, NaN, huge integer     ControlPlaneError           malformed (but authentic)
unknown kind, kind not allowed here    ControlPlaneError           version skew / misuse
body misses a field / wrong type       ControlPlaneError           version skew / bug
addressed to another process (``to``)  AuthenticationError         replayed to another recipient
timestamp outside the skew window      AuthenticationError         stale: possible replay
seq not above the sender's last one    AuthenticationError         replay
=====================================  ==========================  ==========================

Error messages say what was wrong; they never include the secret or a MAC.
See ``docs/protocol.md`` for the protocol as a whole.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeGuard, TypeVar, cast

from torchpass_slurm import jsonsafe
from torchpass_slurm.control import schema
from torchpass_slurm.control.bodies import Ack, Promote, Reconfigure, Stop
from torchpass_slurm.control.kinds import Kind, ReportKind
from torchpass_slurm.control.rank_bodies import (
    MAX_STATE_CHARS,
    MAX_TASKS,
    Bye,
    Heartbeat,
    Hello,
    RankStateCopy,
    Standby,
)
from torchpass_slurm.control.refusals import RefusalLog, cause_of
from torchpass_slurm.control.reports import ReportEnvelope
from torchpass_slurm.errors import AuthenticationError, ControlPlaneError

logger = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = [
    "Kind",
    "ReportKind",
    "HELLO",
    "HEARTBEAT",
    "STANDBY",
    "BYE",
    "PROMOTE",
    "STOP",
    "REPORT",
    "RECONFIGURE",
    "RANK_STATE",
    "ACK",
    "WORKER_KINDS",
    "SUPERVISOR_KINDS",
    "ALL_KINDS",
    "BODY_SCHEMAS",
    "BODY_TYPES",
    "PROTOCOL_VERSION",
    "MAX_FRAME_BYTES",
    "SUPERVISOR",
    "DEFAULT_MAX_SKEW_S",
    "MAC_BYTES",
    "MAX_TASKS",
    "MAX_STATE_CHARS",
    "Message",
    "ReplayGuard",
    "Receiver",
    "SequenceCounter",
    "encode",
    "decode",
    "body_of",
]

# --- kinds --------------------------------------------------------------------


HELLO, HEARTBEAT, STANDBY, BYE, REPORT = (Kind.HELLO, Kind.HEARTBEAT, Kind.STANDBY, Kind.BYE, Kind.REPORT)
RANK_STATE = Kind.RANK_STATE
PROMOTE, STOP, RECONFIGURE, ACK = Kind.PROMOTE, Kind.STOP, Kind.RECONFIGURE, Kind.ACK

#: Kinds a worker may send (the supervisor accepts only these).
WORKER_KINDS: frozenset[str] = frozenset({HELLO, HEARTBEAT, STANDBY, BYE, REPORT, RANK_STATE, ACK})
#: Kinds the supervisor may send (a worker accepts only these).
SUPERVISOR_KINDS: frozenset[str] = frozenset({PROMOTE, STOP, RECONFIGURE, ACK})
ALL_KINDS: frozenset[str] = WORKER_KINDS | SUPERVISOR_KINDS

# --- limits -------------------------------------------------------------------
PROTOCOL_VERSION = b"tp3"  # tp2: report and reconfigure; tp3: the envelope names its recipient
#: Largest payload frame accepted (bytes). Control messages are small; a state
#: transfer never goes over the control plane.
MAX_FRAME_BYTES = 64 * 1024
#: Largest ``sender`` (and ``to``) name accepted (characters).
MAX_SENDER_CHARS = 256
#: The name the supervisor signs with, and the recipient of every worker's message.
SUPERVISOR = "supervisor"
#: Deepest nesting of lists and objects accepted in a payload (the envelope is depth 1).
MAX_NESTING = 16
#: Largest magnitude of an integer accepted in a payload: a signed 64-bit one.
MAX_INT = jsonsafe.MAX_INT
#: Default allowed difference between a message's timestamp and the receiver's
#: clock (seconds). Cluster clocks are NTP-synchronised to well under a second;
#: the window only has to cover skew plus queueing delay.
DEFAULT_MAX_SKEW_S = 30.0
MAC_BYTES = hashlib.sha256().digest_size
#: Prefix of every MAC input: a key used here cannot be confused with any other use.
_MAC_DOMAIN = b"torchpass-slurm control plane\0"

# --- bodies -------------------------------------------------------------------

#: The typed body of each kind (``to_body``/``from_body``): :func:`decode` and :func:`encode`
#: check a body with its ``from_body`` (a report: its envelope, :class:`ReportEnvelope`; its
#: fields are checked where they are read, ``Report.from_body``). Extra fields are allowed
#: (a newer peer may send more); missing or mistyped declared fields are errors.
BODY_TYPES: Mapping[str, Any] = {
    HELLO: Hello,
    HEARTBEAT: Heartbeat,
    STANDBY: Standby,
    BYE: Bye,
    REPORT: ReportEnvelope,
    RANK_STATE: RankStateCopy,
    PROMOTE: Promote,
    STOP: Stop,
    RECONFIGURE: Reconfigure,
    ACK: Ack,
}
#: Required body fields of each kind and their allowed JSON types, derived from :data:`BODY_TYPES`.
BODY_SCHEMAS: Mapping[str, Mapping[str, tuple[type, ...]]] = {
    kind: schema.required_types(cls) for kind, cls in BODY_TYPES.items()
}


@dataclass(frozen=True)
class Message:
    """One authenticated control message.

    ``sender`` names the process (e.g. ``"node7/3"`` for local rank 3 on node7,
    or ``"supervisor"``); ``seq`` grows strictly per sender; ``ts`` is the
    sender's wall clock (unix seconds); ``body`` is a JSON object whose
    fields are given by its kind's typed body (:data:`BODY_TYPES`); ``to`` names the
    recipient (the supervisor, or the worker's ``sender`` name), so bytes
    captured on their way to one worker are refused by every other.
    """

    kind: str
    sender: str
    seq: int
    ts: float
    body: Mapping[str, Any] = field(default_factory=dict)
    to: str = SUPERVISOR
    #: the typed body :func:`decode` checked ``body`` with (None: a message not decoded here);
    #: read it with :func:`body_of`
    typed: object = field(default=None, compare=False, repr=False)


class ReplayGuard:
    """Remembers the highest sequence number accepted from each sender.

    One guard per receiver. :meth:`check_and_record` accepts a message only if
    its ``seq`` is strictly above every ``seq`` accepted before from the same
    sender. Senders start their counter from the wall clock in microseconds
    (:class:`SequenceCounter`), so a restarted process continues above its
    predecessor of the same name. Memory grows with the number of distinct
    senders, which only holders of the secret can create. Thread-safe.
    """

    def __init__(self) -> None:
        self._highest: dict[str, int] = {}
        self._lock = threading.Lock()

    def check_and_record(self, sender: str, seq: int) -> None:
        """Record ``seq`` for ``sender``; raise AuthenticationError if it is not new."""
        with self._lock:
            last = self._highest.get(sender)
            if last is not None and seq <= last:
                raise AuthenticationError(
                    f"replayed or reordered control message from {sender!r}: "
                    f"seq {seq} is not above the last accepted seq {last}"
                )
            self._highest[sender] = seq

    def last_seq(self, sender: str) -> int | None:
        """The highest seq accepted from ``sender``, or None if none yet."""
        with self._lock:
            return self._highest.get(sender)


class SequenceCounter:
    """Strictly increasing sequence numbers for one sender; thread-safe.

    Starts at the wall clock in microseconds so that a restarted sender with
    the same name is not mistaken for a replay by a receiver that saw its
    predecessor (as long as the clock is not set back across the restart).
    """

    def __init__(self, start: int | None = None) -> None:
        self._next = time.time_ns() // 1000 if start is None else start
        self._lock = threading.Lock()

    def next(self) -> int:
        """The next sequence number."""
        with self._lock:
            value = self._next
            self._next += 1
            return value


def encode(msg: Message, secret: bytes) -> list[bytes]:
    """The wire frames of ``msg``, authenticated under ``secret``.

    Raises ControlPlaneError if the message itself is invalid (unknown kind,
    body not JSON-serialisable, missing body fields, too large).
    """
    _check_secret(secret)
    _check_header(msg.kind, msg.sender, msg.seq, msg.ts, msg.to)
    _check_body(msg.kind, msg.body)
    obj = {"body": msg.body, "kind": msg.kind, "sender": msg.sender, "seq": msg.seq, "to": msg.to}
    obj["ts"] = msg.ts
    try:
        payload = json.dumps(
            obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
        ).encode("ascii")
    except (TypeError, ValueError) as exc:
        raise ControlPlaneError(
            f"cannot encode {msg.kind!r} message: its body is not plain JSON ({exc})",
            hint="bodies hold only str, int, float, bool, None, lists and str-keyed dicts",
        ) from None
    if len(payload) > MAX_FRAME_BYTES:
        raise ControlPlaneError(
            f"{msg.kind!r} message is {len(payload)} bytes; the limit is {MAX_FRAME_BYTES}"
        )
    return [PROTOCOL_VERSION, payload, _mac(secret, PROTOCOL_VERSION, payload)]


def decode(
    frames: Sequence[bytes],
    secret: bytes,
    *,
    allowed: Collection[str] = ALL_KINDS,
    guard: ReplayGuard | None = None,
    now: float | None = None,
    max_skew_s: float = DEFAULT_MAX_SKEW_S,
    recipient: str | None = None,
) -> Message:
    """Verify and parse the frames of one message.

    ``allowed`` restricts the kinds this receiver accepts (the supervisor
    passes :data:`WORKER_KINDS`). ``recipient``, when given, is the name the
    message must be addressed to (``to``). ``guard``, when given, rejects
    replays and records the message as seen; it is updated only for a message
    that passed every other check. ``now`` defaults to :func:`time.time`.
    """
    _check_secret(secret)
    payload = _check_frames(frames)
    expected = _mac(secret, PROTOCOL_VERSION, payload)
    if not hmac.compare_digest(expected, bytes(frames[2])):
        raise AuthenticationError(
            "control message failed its HMAC check (forged, corrupted, or signed with another job's secret)"
        )
    msg = _parse_payload(payload)
    if msg.kind not in allowed:
        raise ControlPlaneError(
            f"control message of kind {msg.kind!r} is not accepted here; "
            f"expected one of {', '.join(sorted(allowed))}"
        )
    typed = _check_body(msg.kind, msg.body)
    if recipient is not None and msg.to != recipient:
        raise AuthenticationError(
            f"{msg.kind!r} message from {msg.sender!r} is addressed to {msg.to!r}, not to "
            f"{recipient!r} (replayed to another process, or misrouted)"
        )
    _check_fresh(msg, time.time() if now is None else now, max_skew_s)
    if guard is not None:
        guard.check_and_record(msg.sender, msg.seq)
    return Message(msg.kind, msg.sender, msg.seq, msg.ts, msg.body, msg.to, typed)


class Received(Protocol):
    """A received message as its readers see it (a :class:`Message`, or a test's stand-in)."""

    @property
    def body(self) -> Mapping[str, Any]: ...


def body_of(message: Received, cls: type[T]) -> T:
    """``message``'s body as the body class ``cls`` (``Heartbeat``, ``Promote``, ...): the one
    :func:`decode` made, else read now; ControlPlaneError if the body does not fit ``cls``."""
    typed = getattr(message, "typed", None)
    if isinstance(typed, cls):
        return typed
    result: T = cast(Any, cls).from_body(message.body)
    return result


class Receiver:
    """The checking end of one socket: decodes, counts and logs rejections.

    Holds the receiver's :class:`ReplayGuard`. :meth:`accept` never raises for
    a bad message: it returns None, adds one to :attr:`rejected` and logs at
    WARNING, rate-limited per cause (:class:`~torchpass_slurm.control.refusals.RefusalLog`),
    so that a flood of one kind of junk neither fills the log nor hides a
    later problem of another kind.
    """

    def __init__(
        self,
        secret: bytes,
        allowed: Collection[str],
        *,
        recipient: str | None = None,
        max_skew_s: float = DEFAULT_MAX_SKEW_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        _check_secret(secret)
        self.guard = ReplayGuard()
        #: what was dropped, by cause
        self.refusals = RefusalLog(logger, "dropped control message")
        self._secret = secret
        self._allowed = frozenset(allowed)
        self._recipient = recipient
        self._max_skew_s = max_skew_s
        self._clock = clock

    @property
    def rejected(self) -> int:
        """Messages dropped because they failed a check."""
        return self.refusals.total

    def accept(self, frames: Sequence[bytes], origin: str) -> Message | None:
        """The authentic message in ``frames``, or None (``origin`` names the peer in logs)."""
        try:
            return decode(
                frames,
                self._secret,
                allowed=self._allowed,
                guard=self.guard,
                now=self._clock(),
                max_skew_s=self._max_skew_s,
                recipient=self._recipient,
            )
        except ControlPlaneError as exc:
            self.refusals.refuse(cause_of(exc.message), origin, exc.message)
            return None


# --- helpers --------------------------------------------------------------------


def _mac(secret: bytes, version: bytes, payload: bytes) -> bytes:
    return hmac.new(secret, _MAC_DOMAIN + version + b"\0" + payload, hashlib.sha256).digest()


def _check_secret(secret: bytes) -> None:
    if not isinstance(secret, (bytes, bytearray)) or len(secret) < 16:
        raise ControlPlaneError(
            "control-plane secret must be at least 16 bytes",
            hint="load it with torchpass_slurm.control.load_secret",
        )


def _check_frames(frames: Sequence[bytes]) -> bytes:
    """Structural checks that need no key; returns the payload frame."""
    if len(frames) != 3:
        raise ControlPlaneError(f"control message has {len(frames)} frame(s); expected 3")
    version, payload, mac = (bytes(f) for f in frames)
    if version != PROTOCOL_VERSION:
        raise ControlPlaneError(
            f"control message has protocol version {version[:16]!r}; expected {PROTOCOL_VERSION!r}",
            hint="supervisor and workers must run the same torchpass-slurm version",
        )
    if len(payload) > MAX_FRAME_BYTES:
        raise ControlPlaneError(
            f"control message payload is {len(payload)} bytes; the limit is {MAX_FRAME_BYTES}"
        )
    if len(mac) != MAC_BYTES:
        raise ControlPlaneError(f"control message MAC is {len(mac)} bytes; expected {MAC_BYTES}")
    return payload


_ENVELOPE = frozenset({"body", "kind", "sender", "seq", "to", "ts"})


def _parse_payload(payload: bytes) -> Message:
    """The envelope, parsed by :func:`~torchpass_slurm.jsonsafe.loads`: nesting,
    integers and NaN/Infinity are refused before ``json`` can recurse, overflow or let them in."""
    try:
        obj = jsonsafe.loads(payload.decode("ascii"), max_depth=MAX_NESTING)
    except UnicodeDecodeError as exc:
        raise ControlPlaneError(f"control message payload is not JSON: {exc}") from None
    except jsonsafe.JSONRefused as exc:
        raise ControlPlaneError(f"control message payload {exc}") from None
    if not isinstance(obj, dict) or set(obj) != _ENVELOPE:
        seen = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise ControlPlaneError(
            f"control message payload has fields {seen}; expected {', '.join(sorted(_ENVELOPE))}"
        )
    _check_header(obj["kind"], obj["sender"], obj["seq"], obj["ts"], obj["to"])
    if not isinstance(obj["body"], dict):
        raise ControlPlaneError(
            f"control message body is a {type(obj['body']).__name__}; expected a JSON object"
        )
    return Message(obj["kind"], obj["sender"], obj["seq"], float(obj["ts"]), obj["body"], obj["to"])


def _check_header(kind: object, sender: object, seq: object, ts: object, to: object) -> None:
    if not isinstance(kind, str) or kind not in ALL_KINDS:
        raise ControlPlaneError(
            f"unknown control message kind {kind!r}; expected one of {', '.join(sorted(ALL_KINDS))}"
        )
    for name, value in (("sender", sender), ("to", to)):
        if not isinstance(value, str) or not 0 < len(value) <= MAX_SENDER_CHARS:
            raise ControlPlaneError(
                f"control message {name} must be a non-empty string of at most {MAX_SENDER_CHARS} "
                f"characters; got {type(value).__name__}"
            )
    if not _is_int(seq) or not 0 <= seq <= MAX_INT:
        raise ControlPlaneError(f"control message seq must be a non-negative integer; got {seq!r}")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
        raise ControlPlaneError(f"control message ts must be a finite number; got {ts!r}")
    if isinstance(ts, int) and abs(ts) > MAX_INT:
        raise ControlPlaneError(f"control message ts must be a finite number; got {ts!r}")


def _check_body(kind: str, body: object) -> object:
    """The typed body of ``body`` (its kind's ``from_body``); ControlPlaneError if it does not fit."""
    if not isinstance(body, Mapping):
        raise ControlPlaneError(f"{kind!r} body is a {type(body).__name__}; expected a dict")
    return BODY_TYPES[kind].from_body(body)


def _check_fresh(msg: Message, now: float, max_skew_s: float) -> None:
    skew = msg.ts - now
    if abs(skew) > max_skew_s:
        raise AuthenticationError(
            f"{msg.kind!r} message from {msg.sender!r} is stamped {skew:+.1f} s from this "
            f"host's clock; the window is ±{max_skew_s:g} s (stale, replayed, or clocks "
            "out of sync)",
            hint="check that the nodes' clocks are synchronised (chrony/ntpd)",
        )


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
