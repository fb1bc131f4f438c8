"""TorchTransport: torch.distributed point-to-point on one process group.

Uses the ``ProcessGroup`` object's own ``send``/``recv`` (the C++ ops behind
``dist.isend``/``dist.irecv``), so it works on the default group, on a group
from ``dist.new_group``, and on a ``ProcessGroupGloo`` built directly over a
``PrefixStore`` (one per epoch, as the runtime does) that was never registered
as the default group. ``peer_rank`` is the peer's rank *in that group*.

Timeouts: every operation is started asynchronously and then waited on with
``Work.wait(timeout)``. Gloo honours that timeout per operation (it raises
"Timed out waiting ...ms for recv operation to complete" and closes the pair,
so the group is unusable afterwards: build the next epoch's group). NCCL's
``wait`` does not block the host, so with NCCL the bound is the group's own
timeout (and its watchdog); set it when building the group. A dead peer is seen
at once with gloo ("Connection closed by peer").

Buffers must live on the group's device: CPU tensors for gloo, CUDA tensors
for NCCL.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from torchpass_slurm.errors import TransferError
from torchpass_slurm.transfer.transport import AsyncTransport, Handle, timeout_error

if TYPE_CHECKING:
    import torch

__all__ = ["TorchTransport"]

logger = logging.getLogger(__name__)

#: Message tag of this transport's point-to-point operations.
DEFAULT_TAG = 7077


class _WorkHandle(Handle):
    def __init__(self, transport: TorchTransport, work: Any, op: str, nbytes: int) -> None:
        self._transport = transport
        self._work = work
        self._op = op
        self._nbytes = nbytes

    def wait(self, timeout: timedelta) -> None:
        try:
            self._work.wait(timeout)
        except RuntimeError as exc:
            raise self._transport.translate(exc, self._op, self._nbytes, timeout) from exc


class TorchTransport(AsyncTransport):
    """Point-to-point over a torch.distributed process group (gloo or NCCL)."""

    name = "torch"

    def __init__(self, peer_rank: int, group: Any | None = None, *, tag: int = DEFAULT_TAG) -> None:
        super().__init__()
        import torch.distributed as dist

        if group is None:
            group = dist.group.WORLD if dist.is_initialized() else None
            if group is None:
                raise TransferError(
                    "TorchTransport without a group needs an initialized default process group",
                    hint="call torch.distributed.init_process_group first, or pass group=",
                )
        self.group = group
        self.peer = int(peer_rank)
        self.tag = int(tag)
        if self.peer == group.rank() or not 0 <= self.peer < group.size():
            raise TransferError(
                f"peer rank {self.peer} is not another rank of a group of size {group.size()} "
                f"(this rank is {group.rank()})"
            )
        with contextlib.suppress(AttributeError, RuntimeError):  # name() exists on every backend we use
            self.name = f"torch-{group.name()}"

    def translate(self, exc: RuntimeError, op: str, nbytes: int, timeout: timedelta) -> TransferError:
        """Turn a backend RuntimeError into TransferTimeout / TransferError."""
        text = str(exc)
        if "Timed out" in text or "timed out" in text or "Timeout" in text:
            return timeout_error(self.name, op, nbytes, timeout, f"peer rank {self.peer}")
        first = text.splitlines()[0] if text else type(exc).__name__
        return TransferError(
            f"{self.name}: {op} of {nbytes} bytes with peer rank {self.peer} failed: {first}",
            hint="the peer is probably gone; rebuild the group and retry with another donor",
        )

    def _start(self, op: str, buf: torch.Tensor, timeout: timedelta) -> Handle:
        try:
            if op == "send":
                work = self.group.send([buf], self.peer, self.tag)
            else:
                work = self.group.recv([buf], self.peer, self.tag)
        except RuntimeError as exc:
            raise self.translate(exc, op, buf.numel(), timeout) from exc
        return _WorkHandle(self, work, op, buf.numel())

    def close(self) -> None:
        """Nothing to release: the process group belongs to the caller."""
