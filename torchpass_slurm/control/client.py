"""The worker's end of the control plane: one ZeroMQ DEALER socket.

A rank's runtime creates one :class:`ControlClient`, says ``hello``, sends
heartbeats from a daemon thread and waits for ``promote``/``stop`` in its main
thread. A ZeroMQ socket must never be used by two threads at once, so every
socket operation here runs under one internal lock; :meth:`ControlClient.recv`
waits in slices of :data:`RECV_SLICE` and releases the lock between slices,
so a heartbeat thread calling :meth:`ControlClient.send` waits at most one
slice. The socket helpers at the bottom are shared with
:mod:`torchpass_slurm.control.server`.

The connection is CURVE-encrypted with the job's client key pair, derived
from the secret (:mod:`~torchpass_slurm.control.security`); a client with
another job's secret never completes the handshake, and its messages stay
queued until :data:`HWM` makes :meth:`ControlClient.send` fail. Messages
from the supervisor must be addressed to this client's ``sender`` name.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import zmq

from torchpass_slurm.control.linkwatch import LinkWatch
from torchpass_slurm.control.messages import (
    DEFAULT_MAX_SKEW_S,
    MAX_FRAME_BYTES,
    SUPERVISOR,
    SUPERVISOR_KINDS,
    Message,
    Receiver,
    SequenceCounter,
    encode,
)
from torchpass_slurm.control.security import (
    DEFAULT_LIMITS,
    SocketLimits,
    apply_limits,
    derive_keys,
    make_curve_client,
)
from torchpass_slurm.errors import ControlPlaneError

__all__ = ["ControlClient", "RECV_SLICE", "HWM", "configure_socket", "timeout_ms"]

logger = logging.getLogger(__name__)

#: Longest time :meth:`ControlClient.recv` holds the socket lock in one go.
RECV_SLICE = timedelta(milliseconds=50)
#: Messages queued per peer and direction before sends fail (ZeroMQ high-water mark).
HWM = 1000


class ControlClient:
    """Authenticated connection from one worker process to the supervisor.

    ``sender`` names this process on the control plane (e.g. ``"node7/3"``);
    it must be unique among live processes of the job. Thread-safe (see the
    module docstring). Use as a context manager or call :meth:`close`.
    """

    def __init__(
        self,
        endpoint: str,
        secret: bytes,
        sender: str,
        *,
        max_skew_s: float = DEFAULT_MAX_SKEW_S,
        clock: Callable[[], float] = time.time,
        limits: SocketLimits = DEFAULT_LIMITS,
    ) -> None:
        if sender == SUPERVISOR:
            raise ControlPlaneError(f"a worker may not call itself {SUPERVISOR!r}")
        self.endpoint = endpoint
        self.sender = sender
        self._secret = secret
        self._clock = clock
        self._seq = SequenceCounter()
        self._receiver = Receiver(
            secret, SUPERVISOR_KINDS, recipient=sender, max_skew_s=max_skew_s, clock=clock
        )
        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        configure_socket(self._sock, limits)
        make_curve_client(self._sock, derive_keys(secret))
        #: the connection's events: since when the supervisor is unreachable (``link_down_for``)
        self._watch = LinkWatch(self._sock)
        try:
            self._sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ControlPlaneError(
                f"cannot connect to the control plane at {endpoint!r}: {exc}",
                hint="TORCHPASS_CONTROL must look like tcp://HOST:PORT",
            ) from None

    def send(self, kind: str, body: Mapping[str, Any]) -> Message:
        """Queue one message to the supervisor and return it; never blocks.

        Raises ControlPlaneError if the message is invalid or if the outgoing
        queue is full (the supervisor has not read :data:`HWM` messages).
        """
        msg = Message(kind, self.sender, self._seq.next(), self._clock(), dict(body))
        frames = encode(msg, self._secret)
        with self._lock:
            try:
                self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:
                raise ControlPlaneError(
                    f"cannot send {kind!r} to the supervisor at {self.endpoint}: "
                    f"{HWM} messages are already queued",
                    hint="the supervisor is unreachable or not reading",
                ) from None
            except zmq.ZMQError as exc:
                raise ControlPlaneError(f"cannot send {kind!r} to the supervisor: {exc}") from None
        return msg

    def recv(self, timeout: timedelta) -> Message | None:
        """The next authentic message from the supervisor, or None after ``timeout``.

        Messages that fail a check are dropped, counted in :attr:`rejected`
        and logged; the wait goes on until ``timeout``.
        """
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            left = deadline - time.monotonic()
            msg = self._recv_slice(min(RECV_SLICE, timedelta(seconds=max(left, 0))))
            if msg is not None:
                return msg
            if left <= 0:
                return None

    def recv_or_wake(self, timeout: timedelta, wake_fd: int | None = None) -> Message | None:
        """The next authentic message, or None after ``timeout`` or as soon as ``wake_fd`` (if
        any) is readable: one poll, holding the lock, for the one thread that owns this client
        (the heartbeat thread, woken by its outbox; a spare in standby, with nothing to wake it).
        A message that fails a check ends the wait too."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        if wake_fd is not None:
            poller.register(wake_fd, zmq.POLLIN)
        poller.register(self._watch.monitor, zmq.POLLIN)
        with self._lock:
            try:
                ready = dict(poller.poll(timeout_ms(timeout)))
                if self._watch.monitor in ready:
                    self._watch.read()
                if self._sock not in ready:
                    return None
                frames = self._sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                raise ControlPlaneError(f"cannot receive from the supervisor: {exc}") from None
            return self._receiver.accept(frames, "the supervisor")

    def _recv_slice(self, wait: timedelta) -> Message | None:
        """At most one message within ``wait``, holding the lock throughout."""
        with self._lock:
            try:
                if not self._sock.poll(timeout_ms(wait)):
                    return None
                frames = self._sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                raise ControlPlaneError(f"cannot receive from the supervisor: {exc}") from None
            return self._receiver.accept(frames, "the supervisor")

    def link_down_for(self) -> float | None:
        """Seconds this socket has had no connection to the supervisor (after having had one),
        or None while it has one (``control/linkwatch.py``)."""
        with self._lock:
            return self._watch.down_for()

    @property
    def rejected(self) -> int:
        """Messages received and dropped because they failed a check."""
        return self._receiver.rejected

    def close(self) -> None:
        """Close the socket at once (unsent messages are dropped)."""
        with self._lock:
            self._watch.close()
            self._sock.close(linger=0)
            self._ctx.term()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def configure_socket(sock: zmq.Socket[bytes], limits: SocketLimits = DEFAULT_LIMITS) -> None:
    """Options every control-plane socket gets: no linger, bounded queues and frames,
    a handshake timeout and ZMTP heartbeats (:class:`~torchpass_slurm.control.security.SocketLimits`)."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    # A peer that sends a larger frame is disconnected by ZeroMQ before the
    # frame is buffered: an unauthenticated peer cannot make us allocate much.
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + 1024)
    apply_limits(sock, limits)


def timeout_ms(timeout: timedelta) -> int:
    """A non-negative timeout in whole milliseconds, as zmq's poll wants it."""
    return max(0, round(timeout.total_seconds() * 1000))
