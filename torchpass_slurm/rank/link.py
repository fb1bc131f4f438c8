"""A rank's link to the supervisor: the control client it needs, and the heartbeat thread.

Once started, :class:`Heartbeat` owns the control client: it sends a
heartbeat every interval (on a node with per-node heartbeats, through its
:class:`~torchpass_slurm.rank.nodebeat.NodeBeat`: local rank 0 sends one for
the node, the others hand theirs to it), the reports the training thread queued in the
:class:`Outbox`, hands every incoming message to the runtime, and says ``bye`` when closed.
Nothing here imports zmq until :func:`connect_control` runs.

Between two heartbeats the thread sleeps in one poll of the control socket and of the
outbox's wake-up pipe: a message from the supervisor or a report put in the outbox wakes it
at once, and nothing else does. (It used to wake every 50 ms to look at the outbox: 20
wake-ups a second per rank, and a rank-state copy could wait 50 ms to leave.) A client
without :meth:`ControlClientLike.recv_or_wake` (the tests' fakes) is polled every
:data:`OUTBOX_SLICE_S` as before.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from torchpass_slurm.control.messages import Kind
from torchpass_slurm.control.schema import JSONObject
from torchpass_slurm.errors import ControlPlaneError
from torchpass_slurm.rank.nodebeat import NodeBeat
from torchpass_slurm.rank.orphan import Orphan
from torchpass_slurm.transfer.seal import Seal

__all__ = [
    "JobSeals",
    "Message",
    "ControlClientLike",
    "ClientFactory",
    "connect_control",
    "Heartbeat",
    "Outbox",
    "OUTBOX_SLICE_S",
    "wait_for_promotion",
]

#: With a client that cannot wait on the outbox's pipe, the heartbeat thread looks at the
#: outbox this often (seconds).
OUTBOX_SLICE_S = 0.05


class Outbox(queue.Queue[tuple[str, JSONObject]]):
    """The messages the training thread hands to the heartbeat thread, with a wake-up pipe:
    every :meth:`put` writes a byte to it, so a thread polling :meth:`fileno` wakes at once."""

    def __init__(self) -> None:
        super().__init__()
        self._read, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def put(self, item: tuple[str, JSONObject], block: bool = True, timeout: float | None = None) -> None:
        super().put(item, block, timeout)
        self.wake()

    def wake(self) -> None:
        """Wake the thread that polls :meth:`fileno` (a full pipe is awake already)."""
        with contextlib.suppress(OSError):  # BlockingIOError: the pipe is full, a wake-up is pending
            os.write(self._write, b"\0")

    def fileno(self) -> int:
        """The pipe's read end: readable while a wake-up is pending."""
        return self._read

    def clear_wakeups(self) -> None:
        """Read the pending wake-ups (before the queue is emptied, so none is lost)."""
        with contextlib.suppress(OSError):  # BlockingIOError: none left
            while os.read(self._read, 4096):
                pass

    def close(self) -> None:
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)


class Message(Protocol):
    """A received control message (what the control client returns); read-only."""

    @property
    def kind(self) -> str: ...
    @property
    def body(self) -> Mapping[str, Any]: ...


class ControlClientLike(Protocol):
    """What the runtime needs from :class:`torchpass_slurm.control.client.ControlClient`."""

    def send(self, kind: str, body: JSONObject) -> object: ...

    def recv(self, timeout: datetime.timedelta) -> Message | None: ...

    def close(self) -> None: ...

    # optional: ``recv_or_wake(timeout, fd=None) -> Message | None``, a wait that a readable ``fd`` ends


#: Makes a connected client: (endpoint, secret file, sender id) -> client.
ClientFactory = Callable[[str, str, str], ControlClientLike]


def connect_control(endpoint: str, secret_file: str, sender: str) -> ControlClientLike:
    """Connect to the supervisor's control plane (the real client; imports zmq)."""
    from pathlib import Path

    from torchpass_slurm.control.client import ControlClient
    from torchpass_slurm.control.secret import load_secret

    return ControlClient(endpoint, load_secret(Path(secret_file)), sender)


class JobSeals:
    """Holds the job's secret for the rank's data plane: each state transfer's
    :class:`~torchpass_slurm.transfer.seal.Seal`, and the key to the job's store (read once,
    on first use). Without a secret file (a plain rank, outside tp run) there is no seal: the
    stream is then unsealed."""

    def __init__(self, secret_file: str | None, job_id: str) -> None:
        self.secret_file, self.job_id = secret_file, job_id
        self._secret: bytes | None = None

    def secret(self) -> bytes | None:
        """The job's secret (read on first use), or None without a secret file."""
        if not self.secret_file:
            return None
        if self._secret is None:
            from pathlib import Path

            from torchpass_slurm.control.secret import load_secret

            self._secret = load_secret(Path(self.secret_file))
        return self._secret

    def seal(self, epoch: int, step: int, donor: int, receiver: int) -> Seal | None:
        """The seal of ``step``'s transfer from rank ``donor`` to rank ``receiver`` in ``epoch``
        (both ends compute the same)."""
        secret = self.secret()
        if secret is None:
            return None
        return Seal(secret, f"job {self.job_id} epoch {epoch} step {step} rank {donor}->rank {receiver}")


def wait_for_promotion(
    client: ControlClientLike,
    interval: datetime.timedelta,
    standby: JSONObject,
    beat: Callable[[], JSONObject],
    log: logging.LoggerAdapter[logging.Logger],
    timeout: datetime.timedelta | None,
    orphan: Orphan | None = None,
) -> Message:
    """A spare's standby: say ``standby``, then heartbeat every ``interval`` until the
    supervisor's ``promote`` or ``stop`` (returned). Each wait is one poll of the whole
    interval where the client can (nothing else uses it in standby), not 20 wake-ups a
    second. ControlPlaneError after ``timeout``; with an ``orphan``, the process ends the job
    and exits once the supervisor is gone (``rank/orphan.py``)."""
    client.send(Kind.STANDBY, standby)
    log.info("standby: waiting for promote or stop")
    waited = datetime.timedelta(0)
    receive = getattr(client, "recv_or_wake", None)
    if not callable(receive):
        receive = client.recv
    while timeout is None or waited < timeout:
        msg = receive(interval)
        waited += interval
        if orphan is not None:
            orphan.check(client)
        if msg is None:
            client.send(Kind.HEARTBEAT, beat())
        elif msg.kind in (Kind.PROMOTE, Kind.STOP):
            return msg
        else:
            log.warning("ignoring unexpected %r message in standby", msg.kind)
    raise ControlPlaneError(
        f"no promote or stop message within {timeout} of standby",
        hint="is the supervisor (tp run) still alive?",
    )


class Heartbeat(threading.Thread):
    """Owns the control client once started: heartbeats, the outbox, incoming messages, bye."""

    def __init__(
        self,
        client: ControlClientLike,
        interval: float,
        *,
        beat: Callable[..., JSONObject],
        on_message: Callable[[Message], None],
        outbox: queue.Queue[tuple[str, JSONObject]],
        log: logging.LoggerAdapter[logging.Logger],
        node: NodeBeat | None = None,
        orphan: Orphan | None = None,
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
        #: what to do once the supervisor is gone (None: nothing; the rank waits for its orders)
        self._orphan = orphan
        self.closing = threading.Event()

    def run(self) -> None:
        wake = self._outbox.fileno() if isinstance(self._outbox, Outbox) else None
        waits = wake is not None and callable(getattr(self._client, "recv_or_wake", None))
        try:
            next_beat = 0.0
            while not self.closing.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    self._heartbeat()
                    next_beat = now + self._interval.total_seconds()
                if waits:
                    self._outbox.clear_wakeups()  # type: ignore[attr-defined]
                self._flush_outbox()
                left = max(0.0, next_beat - now)
                msg = self._recv(left, wake) if waits else self._recv(min(OUTBOX_SLICE_S, left))
                if msg is not None:
                    self._on_message(msg)
                if self._orphan is not None:
                    self._orphan.check(self._client)
            self._flush_outbox()
            self._send(Kind.BYE, self._beat(state="done"))
        finally:
            if self._node is not None:
                self._node.close()
            self._client.close()

    def stop(self) -> None:
        """Ask the thread to say bye and end (it wakes at once where it waits on the outbox)."""
        self.closing.set()
        if isinstance(self._outbox, Outbox):
            self._outbox.wake()

    def _heartbeat(self) -> None:
        body: JSONObject | None = self._beat()
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

    def _send(self, kind: str, body: JSONObject) -> None:
        try:
            self._client.send(kind, body)
        except ControlPlaneError as exc:  # keep training; the supervisor judges missing heartbeats
            self._log.warning("could not send %s to the supervisor: %s", kind, exc)

    def _recv(self, seconds: float, wake: int | None = None) -> Message | None:
        try:
            if wake is not None:
                woken: Message | None = self._client.recv_or_wake(  # type: ignore[attr-defined]
                    datetime.timedelta(seconds=seconds), wake
                )
                return woken
            return self._client.recv(datetime.timedelta(seconds=seconds))
        except ControlPlaneError as exc:
            self._log.warning("control plane receive failed: %s", exc)
            self.closing.wait(self._interval.total_seconds())
            return None
