"""Chunk plumbing shared by donor and receiver: byte views, spans, small int messages.

The stream is the tensors' bytes back to back, cut into ``chunk_bytes``
pieces; a chunk may span tensor boundaries. :class:`ChunkMap` maps a chunk to
the ``(tensor, byte range)`` pieces it covers, and hands out a zero-copy view
when the chunk lies inside one contiguous CPU tensor. The pieces of a chunk on
a GPU cross to the host in one copy through a bucket (``device_stage.py``).
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

from torchpass_slurm.errors import TransferError
from torchpass_slurm.transfer.device_stage import DeviceOps, DeviceStager

if TYPE_CHECKING:
    import torch

    from torchpass_slurm.transfer.manifest import Manifest
    from torchpass_slurm.transfer.transport import Transport

__all__ = ["ChunkMap", "send_ints", "recv_ints", "HEADER", "FLAG_SEALED", "pack_header", "unpack_header"]

#: Stream header: magic, format version, flags, manifest length (little endian).
HEADER = struct.Struct("<4sHHQ")
MAGIC = b"TPST"
VERSION = 1
#: Header flag: the manifest is followed by its MAC and every chunk digest is a MAC (``seal.py``).
FLAG_SEALED = 1
_KNOWN_FLAGS = FLAG_SEALED


def pack_header(manifest_len: int, flags: int = 0) -> torch.Tensor:
    """The 16-byte header that precedes the manifest."""
    return _tensor(HEADER.pack(MAGIC, VERSION, flags, manifest_len))


def unpack_header(buf: torch.Tensor) -> tuple[int, int]:
    """The manifest length and the flags from a header; TransferError if it is not ours."""
    magic, version, flags, length = HEADER.unpack(bytes(buf.numpy()))
    if magic != MAGIC:
        raise TransferError(
            f"the peer did not start a torchpass state stream (got magic {magic!r}, expected {MAGIC!r})",
            hint="is the peer a torchpass donor of the same version?",
        )
    if version != VERSION:
        raise TransferError(
            f"the donor speaks state stream version {version}, this receiver {VERSION}",
            hint="run the same torchpass-slurm version on donor and receiver",
        )
    if flags & ~_KNOWN_FLAGS:
        raise TransferError(
            f"the state stream's header has unknown flags {flags:#06x}",
            hint="run the same torchpass-slurm version on donor and receiver",
        )
    return length, flags


def _tensor(data: bytes) -> torch.Tensor:
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def send_ints(transport: Transport, values: Sequence[int], timeout: timedelta) -> None:
    """Send signed 64-bit ints (a protocol message)."""
    transport.send(_tensor(struct.pack(f"<{len(values)}q", *values)), timeout)


def recv_ints(transport: Transport, count: int, timeout: timedelta) -> list[int]:
    """Receive ``count`` signed 64-bit ints."""
    import torch

    buf = torch.empty(8 * count, dtype=torch.uint8)
    transport.recv(buf, timeout)
    return list(struct.unpack(f"<{count}q", bytes(buf.numpy())))


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's memory (no copy)."""
    import torch

    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.view(torch.uint8)


class ChunkMap:
    """Chunk index -> pieces of the tensors, for one side's tensors in stream order."""

    def __init__(
        self, manifest: Manifest, tensors: Sequence[torch.Tensor], ops: DeviceOps | None = None
    ) -> None:
        self.manifest = manifest
        self.tensors = list(tensors)
        self.offsets = [e.offset for e in manifest.entries]
        self._views: dict[int, torch.Tensor] = {}
        bucket = min(manifest.chunk_bytes, manifest.total_bytes)
        self.stager = DeviceStager(ops if ops is not None else DeviceOps(), self.tensors, self.view, bucket)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A staging buffer on the host (pinned when a tensor is on a GPU)."""
        return self.stager.host_buffer(nbytes)

    def view(self, i: int) -> torch.Tensor:
        """The byte view of tensor ``i`` (a contiguous copy for a non-contiguous one, cached alone)."""
        if i not in self._views:
            t = self.tensors[i]
            if not t.is_contiguous():
                self._views = {k: v for k, v in self._views.items() if self.tensors[k].is_contiguous()}
                t = t.contiguous()
            self._views[i] = byte_view(t)
        return self._views[i]

    def pieces(self, index: int) -> list[tuple[int, int, int, int]]:
        """``(tensor i, start in tensor, length, start in chunk)`` for chunk ``index``."""
        start, end = self.manifest.chunk_span(index)
        out = []
        i = max(bisect.bisect_right(self.offsets, start) - 1, 0)
        pos = start
        while pos < end:
            entry = self.manifest.entries[i]
            t_end = entry.offset + entry.nbytes
            if t_end > pos:
                n = min(end, t_end) - pos
                out.append((i, pos - entry.offset, n, pos - start))
                pos += n
            i += 1
        return out

    def direct(self, index: int) -> torch.Tensor | None:
        """A zero-copy view of chunk ``index`` when it lies in one contiguous CPU tensor."""
        pieces = self.pieces(index)
        if len(pieces) != 1:
            return None
        i, start, n, _ = pieces[0]
        t = self.tensors[i]
        if self.stager.device_of(i) is not None or not t.is_contiguous():
            return None
        return self.view(i)[start : start + n]

    def gather(self, index: int, staging: torch.Tensor) -> torch.Tensor:
        """Copy chunk ``index`` into ``staging`` (on the CPU) and return the filled part."""
        start, end = self.manifest.chunk_span(index)
        out = staging[: end - start]
        self.stager.gather(self.pieces(index), out)
        return out

    def scatter(self, index: int, data: torch.Tensor) -> None:
        """Write a received chunk into the destination tensors."""
        self.stager.scatter(self.pieces(index), data)

    def finish(self) -> None:
        """Wait for the device copies still queued (call once the last chunk was scattered)."""
        self.stager.finish()
