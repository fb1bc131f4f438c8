"""The gate of the supervisor's ROUTER: its ZAP handler and its connection budget, in one thread.

* **ZAP** (ZeroMQ RFC 27): libzmq asks ``inproc://zeromq.zap.01`` of the
  server's context about every peer that finished the CURVE key exchange.
  :class:`Gatekeeper` answers 200 only for the job's client public key
  (:func:`~torchpass_slurm.control.security.derive_keys`) and only while
  fewer than ``max_connections`` connections are established; anything else
  gets 400 and libzmq closes the connection before the peer can name itself.
* **Budget**: the server socket's monitor reports every accepted connection
  with its descriptor. A connection younger than the handshake timeout (plus
  :data:`HANDSHAKE_SLACK_S`) may still be in its handshake (libzmq closes it
  at the timeout otherwise); when more than ``max_pending`` such connections
  are open, the oldest is shut down (``shutdown(2)`` on a duplicate of its
  descriptor, after checking that it is a connected socket on the server's
  own port; libzmq then sees the end of the stream and closes it itself). The
  newest connection, most likely a rank that just connected, survives a flood.

Every refusal is counted per cause and logged at WARNING (rate-limited per
cause, :class:`~torchpass_slurm.control.refusals.RefusalLog`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import OrderedDict

import zmq
from zmq.utils.monitor import parse_monitor_message

from torchpass_slurm.control.client import configure_socket
from torchpass_slurm.control.refusals import RefusalLog
from torchpass_slurm.control.security import CurveKeys, SocketLimits, make_curve_server
from torchpass_slurm.errors import ControlPlaneError

__all__ = ["Gatekeeper", "ZAP_ENDPOINT", "HANDSHAKE_SLACK_S"]

logger = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
#: A connection this much older than the handshake timeout has finished its handshake.
HANDSHAKE_SLACK_S = 1.0
#: How long the gate's thread waits in one poll (it checks for close between polls).
_POLL_MS = 100
_MONITORED = (
    zmq.EVENT_ACCEPTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_FAILED: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshake refused (ZAP)",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake failed (not CURVE with the job's keys, or not ZMTP)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed (timed out or the peer left)",
}


class Gatekeeper:
    """ZAP handler and connection budget of one server socket (see the module docstring).

    Create it before the server socket binds (libzmq must find the ZAP
    handler for the first peer), then :meth:`start` it with the bound port.
    """

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        server: zmq.Socket[bytes],
        keys: CurveKeys,
        limits: SocketLimits,
        *,
        what: str = "a control-plane connection",
    ) -> None:
        self._keys = keys
        self._limits = limits
        self._young_s = limits.handshake_timeout.total_seconds() + HANDSHAKE_SLACK_S
        self._port = 0
        self._stop = threading.Event()
        self._open: OrderedDict[int, float] = OrderedDict()  # fd -> accepted at (monotonic)
        #: what was refused, by cause (the log is rate-limited per cause)
        self.refusals = RefusalLog(logger, f"refused {what}")
        #: connections shed because too many were in their handshake
        self.shed = 0
        self._zap = ctx.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        try:
            self._zap.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            self._zap.close()
            raise ControlPlaneError(f"cannot start the control plane's ZAP handler: {exc}") from None
        self._monitor = server.get_monitor_socket(_MONITORED)
        self._thread = threading.Thread(target=self._run, name="control-gate", daemon=True)

    def start(self, port: int) -> None:
        """Serve ZAP requests and watch connections of the server bound to ``port``."""
        self._port = port
        self._thread.start()

    @property
    def connections(self) -> int:
        """Connections open on the server socket now (as the monitor last reported them)."""
        return len(self._open)

    def close(self) -> None:
        """Stop the thread and close its sockets (before the context is terminated)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        else:
            self._zap.close(linger=0)
            self._monitor.close(linger=0)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(_POLL_MS))
                if self._zap in ready:
                    self._answer(self._zap.recv_multipart())
                if self._monitor in ready:
                    self._on_event(self._monitor.recv_multipart())
        except zmq.ZMQError as exc:  # the context is going away
            logger.debug("control gate stopped: %s", exc)
        finally:
            self._zap.close(linger=0)
            self._monitor.close(linger=0)

    # -- ZAP ---------------------------------------------------------------------------
    def _answer(self, request: list[bytes]) -> None:
        version, request_id = [*request, b"", b""][:2]
        status, text = self._judge(request)
        self._zap.send_multipart([version or b"1.0", request_id, status, text.encode(), b"", b""])

    def _judge(self, request: list[bytes]) -> tuple[bytes, str]:
        # RFC 27: version, request id, domain, address, routing id, mechanism, credentials...
        if len(request) < 7 or request[0] != b"1.0":
            return b"500", "malformed ZAP request"
        address = request[3].decode("ascii", "replace")[:64]
        if request[5] != b"CURVE" or len(request[6]) != 32:
            self.refusals.refuse("not CURVE", address, "a connection without the CURVE mechanism")
            return b"400", "CURVE only"
        if not _same(request[6], self._keys.client_public):
            self.refusals.refuse("unknown client key", address, "a CURVE client key that is not the job's")
            return b"400", "unknown key"
        established = sum(1 for t in self._open.values() if time.monotonic() - t > self._young_s)
        if established >= self._limits.max_connections:
            self.refusals.refuse(
                "connection budget",
                address,
                f"{established} connections are established; the budget is {self._limits.max_connections}",
            )
            return b"400", "connection budget"
        return b"200", "OK"

    # -- the budget ----------------------------------------------------------------------
    def _on_event(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)
        kind, fd = int(event["event"]), int(event["value"])
        if kind == zmq.EVENT_ACCEPTED:
            self._open[fd] = time.monotonic()
            self._open.move_to_end(fd)
            self._enforce()
        elif kind == zmq.EVENT_DISCONNECTED:
            self._open.pop(fd, None)
        elif kind in _FAILED:
            self.refusals.refuse(_FAILED[kind], "a peer", _FAILED[kind])

    def _enforce(self) -> None:
        now = time.monotonic()
        young = [fd for fd, t in self._open.items() if now - t <= self._young_s]
        for fd in young[: max(0, len(young) - self._limits.max_pending)]:
            self._open.pop(fd, None)
            if _shut_down(fd, self._port):
                self.shed += 1
                self.refusals.refuse(
                    "handshake budget",
                    "a peer",
                    f"more than {self._limits.max_pending} connections in their handshake: shed the oldest",
                )


def _same(key: bytes, z85_key: bytes) -> bool:
    from zmq.utils import z85

    return key == z85.decode(z85_key)


def _shut_down(fd: int, port: int) -> bool:
    """``shutdown(2)`` the connection behind ``fd`` if it is a connected TCP socket on ``port``.

    Works on a duplicate, so libzmq's descriptor is never closed under it; the
    checks keep a number that libzmq has meanwhile closed and reused for
    something else from being touched.
    """
    try:
        dup = os.dup(fd)
    except OSError:
        return False
    try:
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return False
    with sock:
        try:
            if sock.type != socket.SOCK_STREAM or sock.getsockname()[1] != port:
                return False
            sock.getpeername()  # the listener itself has no peer: OSError
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
    return True


def bracket(host: str) -> str:
    """An IPv6 literal in brackets, as a tcp:// endpoint needs it."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class GuardedRouter:
    """A ROUTER socket of the job: a CURVE server behind its :class:`Gatekeeper`, bound.

    The one way the job's servers (the control plane, the job store) open their socket:
    ``options`` are set before the bind, ``host`` "" or "*" binds every interface, ``port``
    0 a free port (:attr:`port`). A bind that fails closes everything and raises
    ControlPlaneError naming ``name`` and the address. :meth:`close` closes the socket, the
    gate, then the context, in that order (a context is never left to the collector).
    """

    def __init__(
        self,
        keys: CurveKeys,
        limits: SocketLimits,
        host: str,
        port: int,
        *,
        name: str,
        what: str,
        options: dict[int, int] | None = None,
    ) -> None:
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.LINGER, 0)
        self.sock = self.ctx.socket(zmq.ROUTER)
        configure_socket(self.sock, limits)
        for option, value in (options or {}).items():
            self.sock.setsockopt(option, value)
        make_curve_server(self.sock, keys)
        self.gate = Gatekeeper(self.ctx, self.sock, keys, limits, what=what)
        address = f"tcp://{bracket(host or '*')}:{port or '*'}"
        if ":" in host:
            self.sock.setsockopt(zmq.IPV6, 1)
        try:
            self.sock.bind(address)
        except zmq.ZMQError as exc:
            self.close()
            raise ControlPlaneError(f"cannot bind {name} to {address}: {exc}") from None
        #: the port bound (the one asked for, or the free one found)
        self.port = int(self.sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self.gate.start(self.port)

    def close(self) -> None:
        """Close the socket at once (unsent messages are dropped), the gate, the context."""
        self.sock.close(linger=0)
        self.gate.close()
        self.ctx.term()
