"""The supervisor's end of the control plane: one ZeroMQ ROUTER socket.

Every worker process connects one DEALER (:class:`~torchpass_slurm.control.client.ControlClient`);
the ROUTER tags what each sends with a routing id (``peer_id``) that
:meth:`ControlServer.send` uses to answer. Messages that fail any check
(forged, replayed, stale, malformed) are dropped, counted in
:attr:`ControlServer.rejected` and logged at WARNING: a hostile or broken
peer can never crash the supervisor through this socket.

Not thread-safe: use a server from the supervisor's loop thread only.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import zmq

from torchpass_slurm.control.client import configure_socket, timeout_ms
from torchpass_slurm.control.messages import (
    DEFAULT_MAX_SKEW_S,
    WORKER_KINDS,
    Message,
    Receiver,
    SequenceCounter,
    encode,
)
from torchpass_slurm.errors import ControlPlaneError

__all__ = ["ControlServer", "SUPERVISOR_SENDER", "MAX_BATCH"]

logger = logging.getLogger(__name__)

#: The ``sender`` of every message the supervisor sends.
SUPERVISOR_SENDER = "supervisor"
#: Most messages one :meth:`ControlServer.poll` returns (the rest wait for the next).
MAX_BATCH = 1000
_WILDCARD_HOSTS = {"0.0.0.0", "*", "", "::"}


class ControlServer:
    """Authenticated control-plane endpoint of the supervisor.

    Binds ``tcp://bind_host:port`` (``port=0``: a free port). Workers connect
    to :attr:`endpoint`, built from ``advertise_host`` (default: ``bind_host``,
    or this host's name when binding every interface).
    """

    def __init__(
        self,
        secret: bytes,
        bind_host: str = "0.0.0.0",
        port: int = 0,
        *,
        advertise_host: str | None = None,
        max_skew_s: float = DEFAULT_MAX_SKEW_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._secret = secret
        self._clock = clock
        self._seq = SequenceCounter()
        self._receiver = Receiver(secret, WORKER_KINDS, max_skew_s=max_skew_s, clock=clock)
        self._peers: dict[str, bytes] = {}
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        configure_socket(self._sock)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peer: an error, not silence
        self.port = self._bind(bind_host, port)
        host = advertise_host or (socket.gethostname() if bind_host in _WILDCARD_HOSTS else bind_host)
        #: Where workers connect: ``tcp://HOST:PORT`` (goes to TORCHPASS_CONTROL).
        self.endpoint = f"tcp://{_bracket(host)}:{self.port}"
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
        msg = Message(kind, SUPERVISOR_SENDER, self._seq.next(), self._clock(), dict(body))
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

    def peer_of(self, sender: str) -> bytes | None:
        """The peer id that last sent an authentic message as ``sender``, if any."""
        return self._peers.get(sender)

    def close(self) -> None:
        """Close the socket at once (unsent messages are dropped)."""
        self._sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> ControlServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _bind(self, host: str, port: int) -> int:
        address = f"tcp://{_bracket(host or '*')}:{port or '*'}"
        if ":" in host:
            self._sock.setsockopt(zmq.IPV6, 1)
        try:
            self._sock.bind(address)
        except zmq.ZMQError as exc:
            self.close()
            raise ControlPlaneError(f"cannot bind the control plane to {address}: {exc}") from None
        last = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return int(last.rsplit(":", 1)[1])

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
                accepted.append((peer_id, msg))
        return accepted


def _bracket(host: str) -> str:
    """An IPv6 literal in brackets, as a tcp:// endpoint needs it."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
