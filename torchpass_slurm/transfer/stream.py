"""Send and receive a training state over a :class:`Transport`, without pickle.

Wire format (all integers little endian; docs/design/transfer.md has the
details and the reasons)::

    donor                                         receiver
    header  "TPST" u16 version u16 flags u64 len ->
    manifest JSON (len bytes)                 ->
      + (sealed) its MAC (32 bytes)           ->
                                              <-  i64 start chunk (-1: manifest rejected)
    chunk[start], digest[start],
    chunk[start+1], digest[start+1], ...      ->  verify each, write into the destination
                                              <-  i64 n_bad (-1: gave up), then n_bad x i64
    (n_bad > 0) the bad chunks again + digests ->  ... until n_bad == 0

Sealed: with a :class:`~torchpass_slurm.transfer.seal.Seal` (both ends build
it from the job's secret and the transfer's context) the header says so, the
manifest carries a MAC and every chunk digest is a MAC of the chunk and its
index. A receiver with a seal refuses an unsealed stream, a manifest whose MAC
fails (before parsing it), and treats a chunk whose MAC fails as a bad chunk:
asked again, then the transfer is given up. No forged byte is loaded.

Resume: :class:`ReceiveProgress` remembers the manifest digest and how far the
stream got. A retry with another donor that holds the same state (same
manifest bytes) starts at the first chunk not yet received; chunks that
arrived bad are resent at the end; a different manifest starts at 0.

Pipelining: the donor prepares and checksums chunk i+1 while chunk i is in
flight (two staging buffers, reused); the receiver posts the receive of chunk
i+1 before it verifies chunk i. A chunk that lies inside one contiguous CPU
tensor is sent from / received into that tensor directly (no staging copy); the
pieces of a chunk on a GPU cross in one copy through a bucket and pinned host
buffers (:mod:`.device_stage`; ``device_ops`` stands in for the device in tests).

Test hooks: chunks listed in ``corrupt_chunks`` get one byte flipped after
their digest was computed, on their first transmission only; the environment
can ask for that, and for a donor that stalls mid-stream (:mod:`.hooks`).
"""

from __future__ import annotations

import hmac
import logging
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from torchpass_slurm.errors import TransferError
from torchpass_slurm.transfer.chunks import (
    FLAG_SEALED,
    ChunkMap,
    pack_header,
    recv_ints,
    send_ints,
    unpack_header,
)
from torchpass_slurm.transfer.device_stage import DeviceOps
from torchpass_slurm.transfer.hooks import corrupt_chunks_from_env, take_stall
from torchpass_slurm.transfer.manifest import Manifest, build_manifest, chunk_digest
from torchpass_slurm.transfer.materialize import alloc_limit, check_allocation, materialize
from torchpass_slurm.transfer.seal import MANIFEST_MAC_BYTES, SEALED_DIGEST, Seal, check_sealing
from torchpass_slurm.transfer.transport import Handle, Transport

if TYPE_CHECKING:
    import torch

__all__ = [
    "send_state",
    "recv_state",
    "ReceiveProgress",
    "TransferStats",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_DIGEST",
    "MAX_RESEND_ROUNDS",
]

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 4 << 20
#: crc32 checksums at ~3.9 GB/s on this host, blake2b-128 at ~0.84 GB/s (slower than the wire).
DEFAULT_DIGEST = "crc32"
#: Rounds of resending bad chunks before the receiver gives up.
MAX_RESEND_ROUNDS = 3
#: Largest manifest a receiver accepts.
MAX_MANIFEST_BYTES = 64 << 20
_REJECT = -1


@dataclass
class TransferStats:
    """What one send_state / recv_state call moved."""

    bytes: int = 0  # chunk bytes moved by this call, resends included
    chunks: int = 0  # chunk transmissions, resends included
    seconds: float = 0.0
    retries: int = 0  # bad chunks resent
    resumed_from: int = 0  # first chunk streamed (> 0 when resuming after a dead donor)
    manifest_bytes: int = 0

    @property
    def throughput(self) -> float:
        """Bytes per second."""
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    def done(self, what: str, seconds: float, start: int) -> None:
        """The call ended after ``seconds``, having streamed from chunk ``start``: log its numbers."""
        self.seconds = seconds
        logger.info(
            "state %s: %d bytes in %d chunks, %.3f s (%.0f MB/s), from chunk %d, %d resent",
            what,
            self.bytes,
            self.chunks,
            self.seconds,
            self.throughput / 1e6,
            start,
            self.retries,
        )


@dataclass
class ReceiveProgress:
    """How far a receive got; pass the same object to the retry with the next donor."""

    manifest_digest: str | None = None
    received: int = 0  # chunks [0, received) arrived (good or bad)
    bad: set[int] = field(default_factory=set)
    state: Any = None
    tensors: list[Any] = field(default_factory=list)

    def verified(self) -> int:
        """Chunks that arrived and passed their digest."""
        return self.received - len(self.bad)


# --- donor ------------------------------------------------------------------------------


def send_state(
    transport: Transport,
    state: Mapping[Any, Any],
    *,
    timeout: timedelta,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    meta: Any = None,
    corrupt_chunks: Collection[int] = (),
    digest_algo: str = DEFAULT_DIGEST,
    seal: Seal | None = None,
    device_ops: DeviceOps | None = None,
) -> TransferStats:
    """Stream ``state`` to the receiver at the other end of ``transport``.

    ``timeout`` bounds every single wait (no progress for that long fails the
    transfer), not the whole transfer. With ``seal`` the stream is sealed (the
    chunk digests are MACs, ``digest_algo`` is not used). Tensors on a GPU go
    through a one-chunk bucket on it (``device_ops``: the default is torch's).
    Raises TransferError when the receiver rejects the manifest or gives up, or
    the transport fails.
    """
    began = time.monotonic()
    algo = SEALED_DIGEST if seal is not None else digest_algo
    manifest, tensors = build_manifest(state, chunk_bytes=chunk_bytes, digest_algo=algo, meta=meta)
    raw = manifest.to_json()
    transport.send(pack_header(len(raw), FLAG_SEALED if seal is not None else 0), timeout)
    # A sealed manifest and its MAC are one message (gloo and MPI keep message boundaries).
    transport.send(_bytes_tensor(raw + (seal.manifest_mac(raw) if seal is not None else b"")), timeout)
    [start] = recv_ints(transport, 1, timeout)
    if start == _REJECT:
        raise TransferError("the receiver rejected the state manifest (see the receiver's log for why)")
    if not 0 <= start <= manifest.n_chunks:
        raise TransferError(f"the receiver asked to start at chunk {start} of {manifest.n_chunks}")
    stats = TransferStats(resumed_from=start, manifest_bytes=len(raw))
    sender = _ChunkSender(transport, ChunkMap(manifest, tensors, device_ops), timeout, stats, seal)
    corrupt = set(corrupt_chunks) | corrupt_chunks_from_env()
    sender.send(range(start, manifest.n_chunks), corrupt, take_stall())
    while True:
        bad = _recv_bad_list(transport, manifest.n_chunks, timeout)
        if not bad:
            break
        logger.info("resending %d bad chunk(s): %s", len(bad), bad[:16])
        stats.retries += len(bad)
        sender.send(bad, ())
    stats.done("sent", time.monotonic() - began, start)
    return stats


def _bytes_tensor(data: bytes) -> torch.Tensor:
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _recv_bad_list(transport: Transport, n_chunks: int, timeout: timedelta) -> list[int]:
    [count] = recv_ints(transport, 1, timeout)
    if count == _REJECT:
        raise TransferError(
            f"the receiver gave up: chunks still arrived bad after {MAX_RESEND_ROUNDS} resends",
            hint="the link or a NIC may corrupt data; try another donor or transport",
        )
    bad = recv_ints(transport, count, timeout) if count else []
    if any(not 0 <= i < n_chunks for i in bad):
        raise TransferError(f"the receiver asked for chunks outside 0..{n_chunks - 1}: {bad[:16]}")
    return bad


class _ChunkSender:
    """Double-buffered donor loop: checksum chunk i+1 while chunk i is in flight."""

    def __init__(
        self,
        transport: Transport,
        cmap: ChunkMap,
        timeout: timedelta,
        stats: TransferStats,
        seal: Seal | None,
    ) -> None:
        import torch

        self.transport, self.cmap, self.timeout, self.stats = transport, cmap, timeout, stats
        size, self.digest = chunk_digest(cmap.manifest.digest_algo, seal)
        n = min(cmap.manifest.chunk_bytes, cmap.manifest.total_bytes)
        self.staging = [cmap.host_buffer(n) for _ in range(2)]
        self.digests = [torch.empty(size, dtype=torch.uint8) for _ in range(2)]

    def send(
        self, indices: Iterable[int], corrupt: Collection[int], stall: tuple[int, float] | None = None
    ) -> None:
        inflight: deque[tuple[Handle, Handle]] = deque()
        for k, index in enumerate(indices):
            if stall is not None and index == stall[0]:
                logger.warning("test hook: waiting %.1f s before chunk %d", stall[1], index)
                time.sleep(stall[1])
            while len(inflight) >= 2:  # the slot about to be reused must be free
                _wait_both(inflight.popleft(), self.timeout)
            data = self._prepare(index, k % 2, index in corrupt)
            inflight.append(
                (
                    self.transport.isend(data, self.timeout),
                    self.transport.isend(self.digests[k % 2], self.timeout),
                )
            )
            self.stats.chunks += 1
            self.stats.bytes += data.numel()
        while inflight:
            _wait_both(inflight.popleft(), self.timeout)

    def _prepare(self, index: int, slot: int, corrupt: bool) -> torch.Tensor:
        data = None if corrupt else self.cmap.direct(index)
        if data is None:
            data = self.cmap.gather(index, self.staging[slot])
        self.digests[slot].numpy()[:] = memoryview(self.digest(index, data.numpy().data))
        if corrupt and data.numel():
            logger.warning("test hook: corrupting chunk %d after its digest", index)
            data[0] ^= 0xFF
        return data


def _wait_both(handles: tuple[Handle, Handle], timeout: timedelta) -> None:
    handles[0].wait(timeout)
    handles[1].wait(timeout)


# --- receiver ---------------------------------------------------------------------------


def recv_state(
    transport: Transport,
    *,
    timeout: timedelta,
    into: Mapping[Any, Any] | None = None,
    progress: ReceiveProgress | None = None,
    max_alloc_bytes: int | None = None,
    accept: Callable[[Manifest], None] | None = None,
    seal: Seal | None = None,
    device_ops: DeviceOps | None = None,
) -> tuple[dict[Any, Any], TransferStats]:
    """Receive a state from the donor at the other end of ``transport``.

    Tensors of ``into`` with the same path, dtype and shape (and contiguous)
    are filled in place; the rest is allocated, at most ``max_alloc_bytes``
    (default: :func:`~torchpass_slurm.transfer.materialize.alloc_limit` of
    ``into``), or the manifest is refused before anything is allocated. With
    ``progress`` from a failed attempt, a donor holding the same state
    continues where the last one stopped. Returns the state (a dict) and the
    stats of this call. ``accept`` judges the parsed manifest (its ``meta``,
    its entries) before anything is allocated or written; it raises
    TransferError to refuse it (a sharded receiver checks the donor's shard
    metadata against its own mesh this way). A manifest refused for any reason
    is answered with "rejected" (the donor raises) and raises TransferError here.
    With ``seal`` only a stream sealed with the same key is accepted (module
    docstring); without one, a sealed stream is refused. ``into`` tensors on a
    GPU are filled through a one-chunk bucket on it (``device_ops``, as for send_state).
    """
    began = time.monotonic()
    progress = progress if progress is not None else ReceiveProgress()
    limit = alloc_limit(into) if max_alloc_bytes is None else max_alloc_bytes
    manifest, raw_len = _recv_manifest(transport, timeout, progress, into, limit, accept, seal)
    start = progress.received
    send_ints(transport, [start], timeout)
    stats = TransferStats(resumed_from=start, manifest_bytes=raw_len)
    cmap = ChunkMap(manifest, progress.tensors, device_ops)
    receiver = _ChunkReceiver(transport, cmap, timeout, stats, progress, seal)
    receiver.receive(range(start, manifest.n_chunks), streaming=True)
    for _ in range(MAX_RESEND_ROUNDS):
        if not progress.bad:
            break
        bad = sorted(progress.bad)
        logger.warning("%d chunk(s) failed their digest, asking for them again: %s", len(bad), bad[:16])
        send_ints(transport, [len(bad)], timeout)
        send_ints(transport, bad, timeout)
        stats.retries += len(bad)
        receiver.receive(bad, streaming=False)
    if progress.bad:
        send_ints(transport, [_REJECT], timeout)
        raise TransferError(
            f"{len(progress.bad)} chunk(s) still failed their digest after {MAX_RESEND_ROUNDS} "
            f"resends: {sorted(progress.bad)[:16]}",
            hint="the link or a NIC may corrupt data; try another donor or transport",
        )
    cmap.finish()  # the last chunks' device copies
    send_ints(transport, [0], timeout)
    stats.done("received", time.monotonic() - began, start)
    return progress.state, stats


def _recv_manifest(
    transport: Transport,
    timeout: timedelta,
    progress: ReceiveProgress,
    into: Mapping[Any, Any] | None,
    limit: int,
    accept: Callable[[Manifest], None] | None = None,
    seal: Seal | None = None,
) -> tuple[Manifest, int]:
    """Read header + manifest (+ its MAC), set up ``progress`` (resume or restart); reject
    politely on errors."""
    import hashlib

    import torch

    header = torch.empty(16, dtype=torch.uint8)
    transport.recv(header, timeout)
    try:
        length, flags = unpack_header(header)
        check_sealing(bool(flags & FLAG_SEALED), seal)
        if length > MAX_MANIFEST_BYTES:
            raise TransferError(
                f"the donor announced a {length}-byte manifest; the limit is {MAX_MANIFEST_BYTES}"
            )
    except TransferError:
        _reject(transport, timeout)
        raise
    raw = torch.empty(length + (MANIFEST_MAC_BYTES if seal is not None else 0), dtype=torch.uint8)
    transport.recv(raw, timeout)
    data = bytes(raw.numpy()[:length])
    digest = hashlib.sha256(data).hexdigest()
    try:
        if seal is not None:
            seal.check_manifest(data, bytes(raw.numpy()[length:]))
        manifest = _decode_manifest(data, digest, progress, into, limit, accept)
        if (manifest.digest_algo == SEALED_DIGEST) != (seal is not None):
            raise TransferError(
                f"the manifest's chunk digest is {manifest.digest_algo}, which does not match the "
                f"stream's {'sealed' if seal is not None else 'unsealed'} header"
            )
    except TransferError:
        _reject(transport, timeout)
        raise
    return manifest, length


#: What decoding untrusted bytes may raise despite the checks; each becomes a TransferError.
_DECODE_ERRORS = (
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    RecursionError,
    OverflowError,
    MemoryError,
    RuntimeError,
)


def _decode_manifest(
    data: bytes,
    digest: str,
    progress: ReceiveProgress,
    into: Mapping[Any, Any] | None,
    limit: int,
    accept: Callable[[Manifest], None] | None = None,
) -> Manifest:
    """Parse, judge (``accept``), bound and (unless resuming) materialize; each failure a TransferError."""
    try:
        manifest = Manifest.from_json(data)
        if accept is not None:
            accept(manifest)
        if progress.manifest_digest == digest:
            logger.info(
                "resuming a state transfer at chunk %d of %d (%d bad to resend)",
                progress.received,
                manifest.n_chunks,
                len(progress.bad),
            )
            return manifest
        check_allocation(manifest, into, limit)
        state, tensors = materialize(manifest, into)
    except _DECODE_ERRORS as exc:  # a check this receiver lacks: still the donor's fault, and told
        raise TransferError(
            f"the state manifest could not be decoded: {type(exc).__name__}: {str(exc)[:200]}",
            hint="donor and receiver must run the same torchpass-slurm version",
        ) from exc
    if progress.manifest_digest is not None:
        logger.info("the donor's state differs from the interrupted transfer's; starting over")
    progress.manifest_digest, progress.received, progress.bad = digest, 0, set()
    progress.state, progress.tensors = state, tensors
    return manifest


def _reject(transport: Transport, timeout: timedelta) -> None:
    try:
        send_ints(transport, [_REJECT], timeout)
    except TransferError as exc:
        logger.debug("could not tell the donor that its manifest was rejected: %s", exc)


class _ChunkReceiver:
    """Receiver loop: post chunk i+1's receive, then verify and place chunk i."""

    def __init__(
        self,
        transport: Transport,
        cmap: ChunkMap,
        timeout: timedelta,
        stats: TransferStats,
        progress: ReceiveProgress,
        seal: Seal | None,
    ) -> None:
        import torch

        self.transport, self.cmap, self.timeout = transport, cmap, timeout
        self.stats, self.progress = stats, progress
        size, self.digest = chunk_digest(cmap.manifest.digest_algo, seal)
        n = min(cmap.manifest.chunk_bytes, cmap.manifest.total_bytes)
        self.staging = [cmap.host_buffer(n) for _ in range(2)]
        self.digests = [torch.empty(size, dtype=torch.uint8) for _ in range(2)]

    def receive(self, indices: Iterable[int], *, streaming: bool) -> None:
        pending: tuple[int, int, torch.Tensor, bool, tuple[Handle, Handle]] | None = None
        for k, index in enumerate(indices):
            slot = k % 2
            direct = self.cmap.direct(index)
            start, end = self.cmap.manifest.chunk_span(index)
            target = direct if direct is not None else self.staging[slot][: end - start]
            handles = (
                self.transport.irecv(target, self.timeout),
                self.transport.irecv(self.digests[slot], self.timeout),
            )
            if pending is not None:
                self._finish(*pending, streaming=streaming)
            pending = (index, slot, target, direct is None, handles)
        if pending is not None:
            self._finish(*pending, streaming=streaming)

    def _finish(
        self,
        index: int,
        slot: int,
        data: torch.Tensor,
        staged: bool,
        handles: tuple[Handle, Handle],
        *,
        streaming: bool,
    ) -> None:
        _wait_both(handles, self.timeout)
        self.stats.chunks += 1
        self.stats.bytes += data.numel()
        good = hmac.compare_digest(self.digest(index, data.numpy().data), bytes(self.digests[slot].numpy()))
        if good:
            if staged:
                self.cmap.scatter(index, data)
            self.progress.bad.discard(index)
        else:
            logger.warning("chunk %d failed its %s digest", index, self.cmap.manifest.digest_algo)
            self.progress.bad.add(index)
        if streaming:
            self.progress.received = index + 1
