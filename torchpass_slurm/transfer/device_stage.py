"""Flat buckets for state on a GPU: a chunk crosses the PCIe bus in one copy, never tensor by tensor.

The stream is the tensors' bytes back to back, cut into chunks (``chunks.py``).
A chunk of a model with hundreds of small tensors covers many of them. Copied
piece by piece, every piece is its own device-to-host copy (a launch and a
synchronisation each), the per-tensor overhead that dominated every torchft
transfer number (docs/gpu.md). Here the pieces of a chunk that live on one
device are put together on that device first::

    donor                                              receiver
    pieces on the GPU ──device copies──► bucket        pinned host chunk ──one H2D──► bucket
    bucket ──one D2H (non_blocking)──► pinned host     bucket ──device copies──► the destination
    wait for the copy, digest the host bytes, send     tensors (pre-allocated: into=), wait

The bucket is one chunk (``min(chunk_bytes, total_bytes)``), allocated once
per transfer on the device: never a copy of the state. The digest is computed
over the same host bytes as before, so the wire format, the checks and the
resend of a bad chunk are unchanged; a state on the CPU takes exactly the old
path (no bucket, no pinning).

A chunk's pieces on the CPU are copied on the host; pieces on a second device
(one rank with tensors on two GPUs: unusual) are copied piece by piece, after
the bucket's copy, so the bytes the bucket carried for the gaps are overwritten.

:class:`DeviceOps` is everything that touches a device: which tensor is on one,
the buffers, the copies and the wait. The stream takes it as a parameter, so
the unit tests plan, gather and scatter with CPU tensors standing in for a
GPU's and count the copies (``tests/unit/transfer/test_device_stage.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["DeviceOps", "BucketPlan", "plan_bucket", "DeviceStager", "Piece"]

#: ``(tensor index, start in the tensor, length, start in the chunk)``, as ChunkMap.pieces gives it.
Piece = tuple[int, int, int, int]


class DeviceOps:
    """How the stream reaches a device: torch's CUDA calls. Subclass it to stand in for a GPU."""

    def device_key(self, t: torch.Tensor) -> Any:
        """The device ``t`` lives on, or None for host memory (which needs no bucket)."""
        return None if t.device.type == "cpu" else t.device

    def pin(self) -> bool:
        """Whether host buffers that meet a device should be pinned (page-locked)."""
        import torch

        return bool(torch.cuda.is_available())

    def host_buffer(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """A host staging buffer; pinned memory lets the device copy run as DMA, off the CPU."""
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def device_buffer(self, nbytes: int, device: Any) -> torch.Tensor:
        """The bucket on ``device``."""
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy on one device (or host to host)."""
        dst.copy_(src)

    def transfer(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy between the host and a device: on CUDA without blocking the host (pinned
        memory; :meth:`wait` waits for it), on any other device a blocking copy."""
        dst.copy_(src, non_blocking=dst.is_cuda or src.is_cuda)

    def wait(self, device: Any) -> None:
        """Block until every copy queued on ``device``'s current stream finished (an event)."""
        import torch

        if getattr(device, "type", None) == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            event.synchronize()


@dataclass(frozen=True)
class BucketPlan:
    """How one chunk's pieces move: through the bucket of ``device``, or piece by piece."""

    device: Any  # the device whose pieces go through the bucket; None: nothing on a device
    bucket: tuple[Piece, ...]  # pieces through the bucket, in chunk order
    direct: tuple[Piece, ...]  # pieces copied one by one (host, or a second device)
    lo: int  # the chunk bytes [lo, hi) the bucket covers
    hi: int


def plan_bucket(pieces: Sequence[Piece], device_of: Callable[[int], Any]) -> BucketPlan:
    """Split a chunk's pieces: those on the first device met go through its bucket (pure).

    ``device_of(i)`` is the device of tensor ``i`` (None: host memory). The
    bucket covers the chunk bytes from its first piece's start to its last
    piece's end; pieces in between that are not on the device are in ``direct``.
    """
    device = next((d for d in (device_of(p[0]) for p in pieces) if d is not None), None)
    if device is None:
        return BucketPlan(None, (), tuple(pieces), 0, 0)
    bucket = tuple(p for p in pieces if device_of(p[0]) == device)
    direct = tuple(p for p in pieces if device_of(p[0]) != device)
    lo = bucket[0][3]
    hi = bucket[-1][3] + bucket[-1][2]
    return BucketPlan(device, bucket, direct, lo, hi)


class DeviceStager:
    """One side's bucket and the copies of one transfer (donor: gather; receiver: scatter).

    ``views(i)`` is tensor ``i``'s flat byte view (ChunkMap.view); ``bucket_bytes``
    the bucket's size, one chunk.
    """

    def __init__(
        self,
        ops: DeviceOps,
        tensors: Sequence[torch.Tensor],
        views: Callable[[int], torch.Tensor],
        bucket_bytes: int,
    ) -> None:
        self.ops, self.tensors, self.views, self.bucket_bytes = ops, tensors, views, bucket_bytes
        self._devices: dict[int, Any] = {}
        self._buckets: dict[Any, torch.Tensor] = {}
        self.used: set[Any] = set()

    def device_of(self, i: int) -> Any:
        if i not in self._devices:
            self._devices[i] = self.ops.device_key(self.tensors[i])
        return self._devices[i]

    def any_on_device(self) -> bool:
        """Whether any tensor lives on a device (then host buffers should be pinned)."""
        return any(self.device_of(i) is not None for i in range(len(self.tensors)))

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A staging buffer: pinned when the state meets a device and the ops can pin."""
        return self.ops.host_buffer(nbytes, self.ops.pin() and self.any_on_device())

    def plan(self, pieces: Sequence[Piece]) -> BucketPlan:
        return plan_bucket(pieces, self.device_of)

    def _bucket(self, device: Any) -> torch.Tensor:
        if device not in self._buckets:
            self._buckets[device] = self.ops.device_buffer(self.bucket_bytes, device)
        self.used.add(device)
        return self._buckets[device]

    def gather(self, pieces: Sequence[Piece], out: torch.Tensor) -> None:
        """Fill ``out`` (the chunk, on the host) from the pieces: one device-to-host copy per bucket."""
        plan = self.plan(pieces)
        if plan.device is not None:
            bucket = self._bucket(plan.device)
            for i, t_start, n, c_start in plan.bucket:
                at = c_start - plan.lo
                self.ops.copy(bucket[at : at + n], self.views(i)[t_start : t_start + n])
            self.ops.transfer(out[plan.lo : plan.hi], bucket[: plan.hi - plan.lo])
            self.ops.wait(plan.device)  # the host bytes are digested and sent next
        for i, t_start, n, c_start in plan.direct:
            out[c_start : c_start + n].copy_(self.views(i)[t_start : t_start + n])

    def scatter(self, pieces: Sequence[Piece], data: torch.Tensor) -> None:
        """Write a verified chunk (on the host) into the destination tensors: one host-to-device
        copy per bucket, then copies on the device."""
        plan = self.plan(pieces)
        for i, t_start, n, c_start in plan.direct:
            self.views(i)[t_start : t_start + n].copy_(data[c_start : c_start + n])
        if plan.device is None:
            return
        bucket = self._bucket(plan.device)
        self.ops.transfer(bucket[: plan.hi - plan.lo], data[plan.lo : plan.hi])
        for i, t_start, n, c_start in plan.bucket:
            at = c_start - plan.lo
            self.ops.copy(self.views(i)[t_start : t_start + n], bucket[at : at + n])
        # The host buffer is received into again two chunks later, the bucket at the next chunk.
        self.ops.wait(plan.device)

    def finish(self) -> None:
        """Wait for every copy this stager queued (the receiver's tensors are then complete)."""
        for device in self.used:
            self.ops.wait(device)
