"""The supervisor's end of the control plane: one ZeroMQ ROUTER socket.

Every worker process connects one DEALER (:class:`~torchpass_slurm.control.client.ControlClient`);
the ROUTER tags what each sends with a routing id (``peer_id``) that
:meth:`ControlServer.send` uses to answer. Messages that fail any check
(forged, replayed, stale, malformed) are dropped, counted in
:attr:`ControlServer.rejected` and logged at WARNING: a hostile or broken
peer can never crash the supervisor through this socket.

The socket is a CURVE server (:mod:`~torchpass_slurm.control.security`):
its :class:`~torchpass_slurm.control.gate.Gatekeeper` admits only the job's
client key, so a peer without the secret never finishes the handshake and
never gets a routing id (a peer that claims the routing ids the ROUTER will
hand out next made libzmq abort the whole process when a rank connected).
It binds one address, the job's own (:func:`job_address`), never every
interface; it raises the soft limit on open files and budgets connections.

Not thread-safe: use a server from the supervisor's loop thread only.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import zmq

from torchpass_slurm.control.client import timeout_ms
from torchpass_slurm.control.gate import GuardedRouter, bracket
from torchpass_slurm.control.messages import (
    DEFAULT_MAX_SKEW_S,
    SUPERVISOR,
    WORKER_KINDS,
    Message,
    Receiver,
    SequenceCounter,
    encode,
)
from torchpass_slurm.control.refusals import RefusalLog
from torchpass_slurm.control.security import (
    DEFAULT_LIMITS,
    SocketLimits,
    derive_keys,
    raise_fd_limit,
)
from torchpass_slurm.errors import ControlPlaneError

__all__ = ["ControlServer", "SUPERVISOR_SENDER", "MAX_BATCH", "job_address"]

logger = logging.getLogger(__name__)

#: The ``sender`` of every message the supervisor sends.
SUPERVISOR_SENDER = SUPERVISOR
#: Most messages one :meth:`ControlServer.poll` returns (the rest wait for the next).
MAX_BATCH = 1000
_WILDCARD_HOSTS = {"0.0.0.0", "*", "", "::"}


class ControlServer:
    """Authenticated control-plane endpoint of the supervisor.

    Binds ``tcp://bind_host:port`` (``port=0``: a free port). Workers connect
    to :attr:`endpoint`, built from ``advertise_host`` (default: ``bind_host``,
    or this host's name when binding every interface, which only tests should do).
    """

    def __init__(
        self,
        secret: bytes,
        bind_host: str = "127.0.0.1",
        port: int = 0,
        *,
        advertise_host: str | None = None,
        max_skew_s: float = DEFAULT_MAX_SKEW_S,
        clock: Callable[[], float] = time.time,
        limits: SocketLimits = DEFAULT_LIMITS,
    ) -> None:
        self._secret = secret
        self._clock = clock
        self._seq = SequenceCounter()
        self._receiver = Receiver(
            secret, WORKER_KINDS, recipient=SUPERVISOR, max_skew_s=max_skew_s, clock=clock
        )
        self._peers: dict[str, bytes] = {}
        self._names: dict[bytes, str] = {}  # peer id -> the sender it last spoke as
        self.fd_limit = raise_fd_limit()
        self._router = GuardedRouter(
            derive_keys(secret),
            limits,
            bind_host,
            port,
            name="the control plane",
            what="a control-plane connection",
            options={zmq.ROUTER_MANDATORY: 1},  # unknown peer: an error, not silence
        )
        self._sock, self._gate, self.port = self._router.sock, self._router.gate, self._router.port
        if bind_host in _WILDCARD_HOSTS:
            logger.warning("the control plane listens on every interface (port %d)", self.port)
        host = advertise_host or (socket.gethostname() if bind_host in _WILDCARD_HOSTS else bind_host)
        #: Where workers connect: ``tcp://HOST:PORT`` (goes to TORCHPASS_CONTROL).
        self.endpoint = f"tcp://{bracket(host)}:{self.port}"
        logger.info("control plane listening on %s (bound %s:%d)", self.endpoint, bind_host, self.port)

    def poll(self, timeout: timedelta) -> list[tuple[bytes, Message]]:
        """Authentic messages received, as ``(peer_id, message)`` pairs.

        Returns as soon as at least one authentic message is ready (with every
        other one already queued, up to :data:`MAX_BATCH`), or an empty list
        once ``timeout`` has passed.
        """
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            left = max(0.0, deadline - time.monotonic())
            accepted: list[tuple[bytes, Message]] = []
            if self._sock.poll(timeout_ms(timedelta(seconds=left))):
                accepted = self._drain()
            if accepted or left <= 0:
                return accepted

    def send(self, peer_id: bytes, kind: str, body: Mapping[str, Any]) -> Message:
        """Queue one message to the worker behind ``peer_id`` and return it; never blocks.

        Raises ControlPlaneError if the message is invalid, the peer is not
        connected (any more), or its queue is full.
        """
        to = self._names.get(peer_id)
        if to is None:
            raise ControlPlaneError(
                f"cannot send {kind!r} to peer {peer_id.hex()}: it is not connected (no authentic "
                "message came from it)",
                hint="the worker may have exited; wait for its next hello",
            )
        msg = Message(kind, SUPERVISOR_SENDER, self._seq.next(), self._clock(), dict(body), to)
        frames = encode(msg, self._secret)
        try:
            self._sock.send_multipart([peer_id, *frames], flags=zmq.NOBLOCK)
        except zmq.Again:
            raise ControlPlaneError(
                f"cannot send {kind!r} to peer {peer_id.hex()}: its queue is full"
            ) from None
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise ControlPlaneError(f"cannot send {kind!r} to peer {peer_id.hex()}: {exc}") from None
            raise ControlPlaneError(
                f"cannot send {kind!r} to peer {peer_id.hex()}: it is not connected",
                hint="the worker may have exited; wait for its next hello",
            ) from None
        return msg

    @property
    def rejected(self) -> int:
        """Messages received and dropped because they failed a check."""
        return self._receiver.rejected

    @property
    def refusals(self) -> RefusalLog:
        """Messages dropped, by cause."""
        return self._receiver.refusals

    @property
    def refused_connections(self) -> RefusalLog:
        """Connections refused or shed by the gate (wrong key, failed handshake, over budget), by cause."""
        return self._gate.refusals

    @property
    def connections(self) -> int:
        """Connections open on the socket now (established or in their handshake)."""
        return self._gate.connections

    def peer_of(self, sender: str) -> bytes | None:
        """The peer id that last sent an authentic message as ``sender``, if any."""
        return self._peers.get(sender)

    def close(self) -> None:
        """Close the socket at once (unsent messages are dropped)."""
        self._router.close()

    def __enter__(self) -> ControlServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _drain(self) -> list[tuple[bytes, Message]]:
        accepted: list[tuple[bytes, Message]] = []
        for _ in range(MAX_BATCH):
            try:
                frames = self._sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            peer_id, rest = frames[0], frames[1:]
            msg = self._receiver.accept(rest, f"peer {peer_id.hex()}")
            if msg is not None:
                self._peers[msg.sender] = peer_id
                self._names[peer_id] = msg.sender
                accepted.append((peer_id, msg))
        return accepted


def job_address(host: str) -> str:
    """The address to bind for the job: ``host``'s own, as ranks on other nodes reach it.

    ``host`` (the batch host's name) is resolved here; an IP address stays as
    it is, and ``localhost`` is 127.0.0.1. A name that resolves only to loopback (Debian's ``127.0.1.1`` line
    in ``/etc/hosts``) cannot be reached from other nodes: then the first
    non-loopback address of this host's interfaces toward the network is
    used. Raises ControlPlaneError if nothing fits.
    """
    if host == "localhost" or _is_ip(host):
        return "127.0.0.1" if host == "localhost" else host  # what was asked for: tests, one host
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except OSError as exc:
        raise ControlPlaneError(
            f"cannot resolve this host's name {host!r} to bind the control plane: {exc}",
            hint="set the batch host's address in DNS or /etc/hosts",
        ) from None
    addresses = [str(info[4][0]) for info in infos]
    for address in addresses:
        if not ipaddress.ip_address(address).is_loopback:
            return address
    routed = _routed_address()
    if routed is not None:
        logger.warning("%s resolves to loopback (%s); binding %s instead", host, ", ".join(addresses), routed)
        return routed
    if addresses:
        return addresses[0]  # a single-host job on loopback
    raise ControlPlaneError(f"{host!r} resolves to no address to bind the control plane")


def _routed_address() -> str | None:
    """The local address of the default route (a UDP connect sends nothing)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # TEST-NET-1: never answered, only routed
        address = str(probe.getsockname()[0])
    except OSError:
        return None
    finally:
        probe.close()
    return None if ipaddress.ip_address(address).is_loopback else address


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
