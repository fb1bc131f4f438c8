"""Whether a worker's control socket still has its supervisor: the socket's connection events.

A worker never hears from the supervisor between orders, so silence says nothing; the
connection does. Every control socket runs ZMTP heartbeats (``control/security.py``: 2 s,
10 s timeout), so libzmq closes a connection whose peer stopped answering, a powered-off
batch host included, and reports ``EVENT_DISCONNECTED`` on a monitor socket; a reconnect
that completes its CURVE handshake reports ``EVENT_HANDSHAKE_SUCCEEDED``. :class:`LinkWatch`
reads those events and says since when the link is down (None while up, and before the first
handshake: a worker that never reached its supervisor fails on its own).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

__all__ = ["LinkWatch"]

#: The events that change the answer.
EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


class LinkWatch:
    """The connection events of one connected socket; :attr:`down_since` (monotonic) or None."""

    def __init__(self, sock: zmq.Socket[bytes], clock: Callable[[], float] = time.monotonic) -> None:
        self._sock = sock
        self._clock = clock
        self.monitor = sock.get_monitor_socket(EVENTS)
        self.ever_up = False
        self.down_since: float | None = None

    def read(self) -> None:
        """Take every pending event (never blocks)."""
        while True:
            try:
                frames = self.monitor.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.ever_up, self.down_since = True, None
            elif event == zmq.EVENT_DISCONNECTED and self.ever_up and self.down_since is None:
                self.down_since = self._clock()

    def down_for(self) -> float | None:
        """Seconds the link has been down, or None while it is up."""
        self.read()
        return None if self.down_since is None else self._clock() - self.down_since

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):  # the socket may be closing already
            self._sock.disable_monitor()
        self.monitor.close(linger=0)
