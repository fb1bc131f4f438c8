"""The job's rendezvous store: a key-value store that only the job's ranks can reach.

Every epoch's process group meets here (gloo's pair addresses, the count-in,
a leaving rank's listener), so whoever can write it can redirect a training's
collectives or stop its rendezvous. torch's ``TCPStore`` listens on every
interface with no authentication, and an outsider's idle connections stall
it for minutes (issue 22); this store replaces it under ``tp run``:

* **Only the job's ranks.** The socket is a ZeroMQ ROUTER bound to the job's
  address alone, a CURVE server with key pairs derived from the job's secret
  for this plane (:func:`~torchpass_slurm.control.security.derive_keys`,
  ``plane="store"``). The control plane's :class:`~torchpass_slurm.control.gate.Gatekeeper`
  admits only the job's client key, caps established connections, closes a
  connection whose handshake is not done within its timeout, and sheds the
  oldest half-open ones in a flood. An outsider's bytes never reach
  :func:`~torchpass_slurm.control.store_wire.parse_request`.
* **Waits are parked, not polled.** A ``get`` or ``wait`` on a key that is
  not set yet is answered when the key is set, or with ``timeout`` at its
  deadline (the smaller of the client's and :attr:`StoreServer.max_wait`);
  the loop never blocks on one client.
* **Bounded.** Keys, values, the number of keys, their bytes and the parked
  requests all have limits; a request over one is answered ``error`` and
  changes nothing.

Single-threaded (one loop, plus the gate's thread); the rank side is
:class:`~torchpass_slurm.rank.store.JobStore`. Hosted by ``tp run`` in a child
process (:mod:`~torchpass_slurm.supervisor.store_host`), so neither a flood nor the
store's death takes the supervisor with it.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import zmq

from torchpass_slurm.control.client import timeout_ms
from torchpass_slurm.control.gate import GuardedRouter
from torchpass_slurm.control.refusals import RefusalLog, cause_of
from torchpass_slurm.control.security import (
    DEFAULT_LIMITS,
    SocketLimits,
    derive_keys,
    raise_fd_limit,
)
from torchpass_slurm.control.store_wire import (
    ERROR,
    MAX_VALUE_BYTES,
    OK,
    TIMEOUT,
    Op,
    Request,
    WireError,
    encode_int,
    parse_int,
    parse_request,
)

__all__ = ["StoreServer", "StoreLimits", "DEFAULT_STORE_LIMITS"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreLimits:
    """What the store holds at most (one source of defaults; ``docs/security.md``)."""

    #: The longest a parked get or wait is kept before it is answered ``timeout``.
    max_wait: timedelta = timedelta(minutes=5)
    #: Keys held at once (a 16,384-rank job's epoch sets about two per rank).
    max_keys: int = 1_000_000
    #: Bytes of keys and values held at once.
    max_bytes: int = 1 << 30
    #: Requests parked at once, all clients together.
    max_parked: int = 200_000


DEFAULT_STORE_LIMITS = StoreLimits()


@dataclass(eq=False)
class _Parked:
    """A get or wait that waits for its keys: answered when they are set, or at its deadline."""

    deadline: float
    peer: bytes
    request: Request
    done: bool = False


class StoreServer:
    """The job's store, bound to ``tcp://bind_host:port`` (``port=0``: a free one)."""

    def __init__(
        self,
        secret: bytes,
        bind_host: str,
        port: int = 0,
        *,
        limits: StoreLimits = DEFAULT_STORE_LIMITS,
        socket_limits: SocketLimits = DEFAULT_LIMITS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self._clock = clock
        self._data: dict[bytes, bytes] = {}
        self._bytes = 0
        self._waiting: dict[bytes, list[_Parked]] = {}  # key -> parked requests that need it
        self._deadlines: list[tuple[float, int, _Parked]] = []  # a heap
        self._order = itertools.count()
        self._parked = 0
        #: requests refused, by cause (malformed, over a limit)
        self.refusals = RefusalLog(logger, "refused a store request")
        self.fd_limit = raise_fd_limit()
        self._router = GuardedRouter(
            derive_keys(secret, plane="store"),
            socket_limits,
            bind_host,
            port,
            name="the job's store",
            what="a store connection",
            options={zmq.MAXMSGSIZE: MAX_VALUE_BYTES + (64 << 10)},
        )
        self._sock, self._gate, self.port = self._router.sock, self._router.gate, self._router.port

    def serve(self, stop: threading.Event) -> None:
        """Answer requests until ``stop`` is set (checked at least every 100 ms)."""
        while not stop.is_set():
            self.serve_once(timedelta(milliseconds=100))

    def serve_once(self, timeout: timedelta) -> None:
        """Answer what arrives within ``timeout`` (or by the first parked deadline), then expire."""
        wait = timeout.total_seconds()
        if self._deadlines:
            wait = min(wait, max(0.0, self._deadlines[0][0] - self._clock()))
        if self._sock.poll(timeout_ms(timedelta(seconds=wait))):
            for _ in range(1000):
                try:
                    frames = self._sock.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._handle(frames[0], frames[1:])
        self._expire()

    def close(self) -> None:
        self._router.close()

    # -- requests --------------------------------------------------------------------------
    def _handle(self, peer: bytes, frames: list[bytes]) -> None:
        try:
            request = parse_request(frames)
        except WireError as exc:
            self._refuse(peer, frames[0] if frames else b"", str(exc))
            return
        try:
            payload = self._apply(peer, request)
        except WireError as exc:
            self._refuse(peer, request.request_id, str(exc))
            return
        if payload is not None:
            self._reply(peer, request.request_id, OK, *payload)

    def _apply(self, peer: bytes, request: Request) -> list[bytes] | None:
        """The reply's payload, or None when the request was parked."""
        op, keys = request.op, request.keys
        if op is Op.SET:
            self._put(keys[0], request.value)
            return []
        if op is Op.ADD:
            old = self._data.get(keys[0], b"0")
            value = encode_int(_counter(old) + request.number)
            self._put(keys[0], value)
            return [value]
        if op is Op.COMPARE_SET:
            current = self._data.get(keys[0])
            if (current is None and request.expected == b"") or current == request.expected:
                self._put(keys[0], request.value)
                return [request.value]
            return [current if current is not None else request.expected]
        if op is Op.CHECK:
            return [b"1" if all(k in self._data for k in keys) else b"0"]
        if op is Op.DELETE:
            if keys[0] not in self._data:
                return [b"0"]
            self._bytes -= len(keys[0]) + len(self._data.pop(keys[0]))
            return [b"1"]
        if op is Op.NUM_KEYS:
            return [encode_int(len(self._data))]
        # GET and WAIT: answered now when every key is set, else parked.
        if all(k in self._data for k in keys):
            return [self._data[keys[0]]] if op is Op.GET else []
        self._park(peer, request)
        return None

    def _put(self, key: bytes, value: bytes) -> None:
        old = self._data.get(key)
        grown = len(value) - (len(old) if old is not None else -len(key))
        if old is None and len(self._data) >= self.limits.max_keys:
            raise WireError(f"the store holds {len(self._data)} keys, its limit")
        if self._bytes + grown > self.limits.max_bytes:
            raise WireError(f"the store would hold more than {self.limits.max_bytes} bytes")
        self._data[key] = value
        self._bytes += grown
        for parked in self._waiting.pop(key, ()):
            self._try_answer(parked)

    # -- parked waits ----------------------------------------------------------------------
    def _park(self, peer: bytes, request: Request) -> None:
        if self._parked >= self.limits.max_parked:
            raise WireError(f"{self._parked} requests are waiting already, the store's limit")
        wait_s = min(request.number / 1000, self.limits.max_wait.total_seconds())
        parked = _Parked(self._clock() + wait_s, peer, request)
        self._parked += 1
        heapq.heappush(self._deadlines, (parked.deadline, next(self._order), parked))
        self._wait_for_next_key(parked)

    def _wait_for_next_key(self, parked: _Parked) -> None:
        missing = next(k for k in parked.request.keys if k not in self._data)
        self._waiting.setdefault(missing, []).append(parked)

    def _try_answer(self, parked: _Parked) -> None:
        if parked.done:
            return
        request = parked.request
        if not all(k in self._data for k in request.keys):
            self._wait_for_next_key(parked)
            return
        self._settle(parked)
        payload = [self._data[request.keys[0]]] if request.op is Op.GET else []
        self._reply(parked.peer, request.request_id, OK, *payload)

    def _expire(self) -> None:
        now = self._clock()
        while self._deadlines and self._deadlines[0][0] <= now:
            parked = heapq.heappop(self._deadlines)[2]
            if parked.done:
                continue
            self._settle(parked)
            missing = [k for k in parked.request.keys if k not in self._data]
            text = "still unset: " + ", ".join(k.decode("utf-8", "replace") for k in missing[:8])
            self._reply(parked.peer, parked.request.request_id, TIMEOUT, text.encode())

    def _settle(self, parked: _Parked) -> None:
        """Mark ``parked`` answered (its entries in the key index and heap are skipped from now on)."""
        parked.done = True
        self._parked -= 1
        for key in parked.request.keys:  # the index holds it under at most one key
            waiters = self._waiting.get(key)
            if waiters and any(w is parked for w in waiters):
                waiters[:] = [w for w in waiters if w is not parked]
                if not waiters:
                    del self._waiting[key]
                break

    # -- replies ---------------------------------------------------------------------------
    def _refuse(self, peer: bytes, request_id: bytes, text: str) -> None:
        self.refusals.refuse(cause_of(text), f"peer {peer.hex()}", text)
        self._reply(peer, request_id, ERROR, text.encode("utf-8", "replace"))

    def _reply(self, peer: bytes, request_id: bytes, status: bytes, *payload: bytes) -> None:
        try:
            self._sock.send_multipart([peer, request_id[:8], status, *payload], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the peer left, or does not read: it times out on its side
            logger.debug("store reply to peer %s dropped: %s", peer.hex(), exc)


def _counter(raw: bytes) -> int:
    """A value that ADD may add to: a decimal integer (torch's counters are)."""
    try:
        return parse_int(raw)
    except WireError:
        raise WireError(f"the key's value {raw[:24]!r} is not a counter") from None
