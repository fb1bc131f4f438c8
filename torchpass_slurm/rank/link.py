"""A rank's link to the supervisor: the control client it needs, and the heartbeat thread.

Once started, :class:`Heartbeat` owns the control client: it sends a
heartbeat every interval (on a node with per-node heartbeats, through its
:class:`~torchpass_slurm.rank.nodebeat.NodeBeat`: local rank 0 sends one for
the node, the others hand theirs to it), the reports the training thread queued in the
outbox (within :data:`OUTBOX_SLICE_S`), hands every incoming message to the
runtime, and says ``bye`` when closed. Nothing here imports zmq until
:func:`connect_control` runs.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from torchpass_slurm.control.messages import Kind
from torchpass_slurm.errors import ControlPlaneError
from torchpass_slurm.rank.nodebeat import NodeBeat

__all__ = ["Message", "ControlClientLike", "ClientFactory", "connect_control", "Heartbeat", "OUTBOX_SLICE_S"]

#: The heartbeat thread wakes this often to send queued reports promptly (seconds).
OUTBOX_SLICE_S = 0.05


class Message(Protocol):
    """A received control message (what the control client returns); read-only."""

    @property
    def kind(self) -> str: ...
    @property
    def body(self) -> Mapping[str, Any]: ...


class ControlClientLike(Protocol):
    """What the runtime needs from :class:`torchpass_slurm.control.client.ControlClient`."""

    def send(self, kind: str, body: dict[str, Any]) -> object: ...

    def recv(self, timeout: datetime.timedelta) -> Message | None: ...

    def close(self) -> None: ...


#: Makes a connected client: (endpoint, secret file, sender id) -> client.
ClientFactory = Callable[[str, str, str], ControlClientLike]


def connect_control(endpoint: str, secret_file: str, sender: str) -> ControlClientLike:
    """Connect to the supervisor's control plane (the real client; imports zmq)."""
    from pathlib import Path

    from torchpass_slurm.control.client import ControlClient
    from torchpass_slurm.control.secret import load_secret

    return ControlClient(endpoint, load_secret(Path(secret_file)), sender)


class Heartbeat(threading.Thread):
    """Owns the control client once started: heartbeats, the outbox, incoming messages, bye."""

    def __init__(
        self,
        client: ControlClientLike,
        interval: float,
        *,
        beat: Callable[..., dict[str, Any]],
        on_message: Callable[[Message], None],
        outbox: queue.Queue[tuple[str, dict[str, Any]]],
        log: logging.LoggerAdapter[logging.Logger],
        node: NodeBeat | None = None,
    ) -> None:
        super().__init__(name="torchpass-heartbeat", daemon=True)
        self._client = client
        self._interval = datetime.timedelta(seconds=interval)
        self._beat = beat
        self._on_message = on_message
        self._outbox = outbox
        self._log = log
        #: per-node heartbeats: what this rank does with its beat (None: send it to the supervisor)
        self._node = node
        self.closing = threading.Event()

    def run(self) -> None:
        try:
            next_beat = 0.0
            while not self.closing.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    self._heartbeat()
                    next_beat = now + self._interval.total_seconds()
                self._flush_outbox()
                msg = self._recv(min(OUTBOX_SLICE_S, max(0.0, next_beat - now)))
                if msg is not None:
                    self._on_message(msg)
            self._flush_outbox()
            self._send(Kind.BYE, self._beat(state="done"))
        finally:
            if self._node is not None:
                self._node.close()
            self._client.close()

    def _heartbeat(self) -> None:
        body: dict[str, Any] | None = self._beat()
        if self._node is not None and body is not None:
            body = self._node.periodic(body)  # None: handed to local rank 0
        if body is not None:
            self._send(Kind.HEARTBEAT, body)

    def _flush_outbox(self) -> None:
        while True:
            try:
                kind, body = self._outbox.get_nowait()
            except queue.Empty:
                return
            self._send(kind, body)

    def _send(self, kind: str, body: dict[str, Any]) -> None:
        try:
            self._client.send(kind, body)
        except ControlPlaneError as exc:  # keep training; the supervisor judges missing heartbeats
            self._log.warning("could not send %s to the supervisor: %s", kind, exc)

    def _recv(self, seconds: float) -> Message | None:
        try:
            return self._client.recv(datetime.timedelta(seconds=seconds))
        except ControlPlaneError as exc:
            self._log.warning("control plane receive failed: %s", exc)
            self.closing.wait(self._interval.total_seconds())
            return None
