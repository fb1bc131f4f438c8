"""In-process transports for the receiver's unit tests (the contract tests use real processes).

- :class:`ScriptedDonor`: the receiver's transport to a donor that sends fixed messages
  (a header, a manifest) and records what the receiver answers.
- :func:`queue_pair`: two connected transports on queues, for a donor thread and a receiver.
"""

from __future__ import annotations

import queue
import struct
from collections import deque
from datetime import timedelta

import torch

from torchpass_slurm.errors import TransferError, TransferTimeout
from torchpass_slurm.transfer.chunks import pack_header
from torchpass_slurm.transfer.transport import Transport

REJECTED = struct.pack("<q", -1)


class ScriptedDonor(Transport):
    """Hands the receiver the scripted messages in order; records what it sends back."""

    name = "scripted"

    def __init__(self, *messages: bytes) -> None:
        super().__init__()
        self.script = deque(messages)
        self.sent: list[bytes] = []

    @classmethod
    def with_manifest(cls, raw: bytes) -> ScriptedDonor:
        return cls(bytes(pack_header(len(raw)).numpy()), raw)

    def _send(self, buf: torch.Tensor, timeout: timedelta) -> None:
        self.sent.append(bytes(buf.numpy()))

    def _recv(self, buf: torch.Tensor, timeout: timedelta) -> None:
        if not self.script:
            raise TransferTimeout("scripted: the donor has nothing more to send")
        data = self.script.popleft()
        if len(data) != buf.numel():
            raise TransferError(f"scripted: a {len(data)}-byte message for a {buf.numel()}-byte buffer")
        if data:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def close(self) -> None:
        pass


class QueueTransport(Transport):
    """One end of an in-process pipe: messages keep their boundaries, as with gloo or MPI."""

    name = "queue"

    def __init__(self, inbox: queue.Queue[bytes], outbox: queue.Queue[bytes]) -> None:
        super().__init__()
        self.inbox, self.outbox = inbox, outbox

    def _send(self, buf: torch.Tensor, timeout: timedelta) -> None:
        self.outbox.put(bytes(buf.numpy()))

    def _recv(self, buf: torch.Tensor, timeout: timedelta) -> None:
        try:
            data = self.inbox.get(timeout=timeout.total_seconds())
        except queue.Empty:
            raise TransferTimeout(f"queue: nothing within {timeout}") from None
        if len(data) != buf.numel():
            raise TransferError(f"queue: a {len(data)}-byte message for a {buf.numel()}-byte buffer")
        if data:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def close(self) -> None:
        pass


def queue_pair() -> tuple[QueueTransport, QueueTransport]:
    """(donor's end, receiver's end)."""
    a: queue.Queue[bytes] = queue.Queue()
    b: queue.Queue[bytes] = queue.Queue()
    return QueueTransport(a, b), QueueTransport(b, a)
