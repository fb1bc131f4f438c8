"""Checkpoints of a sharded job: every rank writes and reads its OWN local shards.

The fallback of a sharded job when a lost shard has no replica: the job restarts with the
same mesh and every rank loads the shards it wrote. Nothing is gathered, nothing is
pickled. Each rank's file is the transfer stream's format on disk::

    directory/
      step-00000040/
        shards-00000.tpst     header "TPST" + manifest JSON (canonical) + the tensors' bytes
        shards-00001.tpst     ...
        shards.json           written by rank 0 once every rank's file is complete
      latest                  "step-00000040\\n", replaced atomically (as rank/checkpoint.py)
      .tmp-step-00000050/     a save in progress (or torn by a crash): ignored

The manifest's ``meta`` holds the step, the shard metadata of the transfer (mesh, the
rank's coordinate, each tensor's global shape, stride and placements), a crc32 of every
chunk and, for a trainer with ``rank_state``, that rank's own state (its data loader's
position: bounded JSON, checked as the control plane checks it). A load checks all of it
against the rank's own mesh and freshly built model (``rank/shard_state.py``'s checks),
and every chunk against its checksum, before it writes one byte into the model. The folder
is created private and renamed into place like a DCP checkpoint (``rank/checkpoint.py``'s
helpers).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchpass_slurm.errors import CheckpointError, TransferError
from torchpass_slurm.mesh import MeshLayout
from torchpass_slurm.rank.checkpoint import (
    _barrier,
    _broadcast_int,
    _dist_rank,
    newest_step,
    staged_save,
    step_dir,
)
from torchpass_slurm.rank.shard_state import judge_shard_manifest, load_local_state, local_state, shard_meta

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["save", "load_latest", "latest_step", "COMPLETE", "CHUNK_BYTES"]

#: The file rank 0 writes last: the checkpoint is complete once it exists.
COMPLETE = "shards.json"
#: Bytes per checksummed chunk of a rank's file.
CHUNK_BYTES = 4 << 20
#: Largest manifest a load accepts (as the transfer stream).
MAX_MANIFEST_BYTES = 64 << 20


def _rank_file(folder: Path, rank: int) -> Path:
    return folder / f"shards-{rank:05d}.tpst"


def save(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    layout: MeshLayout,
    directory: str | os.PathLike[str],
    step: int,
    *,
    keep: int = 3,
    rank_state: Mapping[str, Any] | None = None,
) -> Path:
    """Write this rank's shards as part of the checkpoint of ``step`` (every rank calls it);
    ``rank_state`` (name -> Stateful with a JSON state_dict) is saved with them."""

    def write(tmp: Path, rank: int) -> None:
        state, specs = local_state(model, optimizer)
        meta = shard_meta(layout, rank, step, specs)
        if rank_state is not None:
            meta["rank_state"] = _own_state(rank_state, step)
        try:
            _write(_rank_file(tmp, rank), state, meta)
        except OSError as exc:
            raise CheckpointError(
                f"writing rank {rank}'s shards of step {step} into {tmp} failed: {exc}",
                hint="check that the folder is on a shared, writable file system with free space",
            ) from exc

    def seal(tmp: Path) -> None:
        (tmp / COMPLETE).write_text(json.dumps({"step": step, "mesh": layout.to_json()}) + "\n")

    return staged_save(Path(directory), step, keep, write, marker=COMPLETE, make_folder=True, seal=seal)


def _write(path: Path, state: Any, meta: dict[str, Any]) -> None:
    import torch

    from torchpass_slurm.transfer.chunks import ChunkMap, pack_header
    from torchpass_slurm.transfer.manifest import DIGESTS, build_manifest

    manifest, tensors = build_manifest(state, chunk_bytes=CHUNK_BYTES, digest_algo="crc32", meta=meta)
    cmap = ChunkMap(manifest, tensors)
    staging = torch.empty(min(CHUNK_BYTES, manifest.total_bytes), dtype=torch.uint8)
    digest = DIGESTS["crc32"][1]
    chunks = [bytes(cmap.gather(i, staging).numpy()) for i in range(manifest.n_chunks)]
    meta = {**meta, "crc32": [digest(memoryview(c)).hex() for c in chunks]}
    manifest, _ = build_manifest(state, chunk_bytes=CHUNK_BYTES, digest_algo="crc32", meta=meta)
    raw = manifest.to_json()
    with open(path, "wb") as f:
        f.write(bytes(pack_header(len(raw)).numpy()))
        f.write(raw)
        for chunk in chunks:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


def latest_step(directory: str | os.PathLike[str]) -> int | None:
    """The newest complete shard checkpoint's step (``latest`` preferred), or None."""
    return newest_step(Path(directory), COMPLETE)


def load_latest(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    layout: MeshLayout,
    directory: str | os.PathLike[str],
    *,
    rank_state: Mapping[str, Any] | None = None,
) -> int | None:
    """Load this rank's shards of the newest complete checkpoint (rank 0 chooses it), and its
    ``rank_state`` when given; the step, or None with nothing loaded when there is none."""
    directory = Path(directory)
    found = latest_step(directory) if _dist_rank() == 0 else None
    step = _broadcast_int(-1 if found is None else found)
    if step < 0:
        return None
    rank = _dist_rank()
    path = _rank_file(step_dir(directory, step), rank)
    try:
        meta = _read(path, model, optimizer, layout, rank, step)
        if rank_state is not None:
            _load_own_state(rank_state, meta.get("rank_state"), step)
    except OSError as exc:
        raise CheckpointError(
            f"reading {path} failed: {exc}", hint="is the folder shared by every node?"
        ) from exc
    except TransferError as exc:
        raise CheckpointError(
            f"{path} is not rank {rank}'s shards of step {step} on this mesh: {exc}",
            hint="restart with the mesh and model the checkpoint was written with",
        ) from exc
    _barrier()
    return step


def _own_state(objects: Mapping[str, Any], step: int) -> dict[str, Any]:
    from torchpass_slurm.control.rankstate import check_copy
    from torchpass_slurm.errors import ControlPlaneError

    state = {name: obj.state_dict() for name, obj in objects.items()}
    try:
        check_copy(step, state, "the rank state to checkpoint")
    except ControlPlaneError as exc:
        raise CheckpointError(exc.message, hint="rank_state holds small JSON positions") from None
    return state


def _load_own_state(objects: Mapping[str, Any], saved: object, step: int) -> None:
    """Give every rank-state object its saved state, once all of it is checked."""
    from torchpass_slurm.control.rankstate import check_copy
    from torchpass_slurm.errors import ControlPlaneError

    try:
        check_copy(step, saved, "the checkpoint's rank state")
    except ControlPlaneError as exc:
        raise TransferError(f"{exc.message} (a checkpoint written without rank_state?)") from None
    assert isinstance(saved, dict)
    missing = sorted(set(objects) - set(saved))
    if missing:
        raise TransferError(f"the checkpoint's rank state has no {missing} (it has {sorted(saved)})")
    for name, obj in objects.items():
        obj.load_state_dict(saved[name])


def _read(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, layout: MeshLayout, rank: int, step: int
) -> dict[str, Any]:
    """Check and load this rank's file into the model; the manifest's meta."""
    import torch

    from torchpass_slurm.transfer.chunks import HEADER, ChunkMap, unpack_header
    from torchpass_slurm.transfer.manifest import DIGESTS, Manifest
    from torchpass_slurm.transfer.materialize import check_allocation, materialize

    into, _ = local_state(model, optimizer)
    with open(path, "rb") as f:
        length, flags = unpack_header(torch.frombuffer(bytearray(f.read(HEADER.size)), dtype=torch.uint8))
        if flags:
            raise TransferError(f"the file's header has flags {flags:#06x}; a shard checkpoint has none")
        if length > MAX_MANIFEST_BYTES:
            raise TransferError(
                f"the file announces a {length}-byte manifest; the limit is {MAX_MANIFEST_BYTES}"
            )
        manifest = Manifest.from_json(f.read(length))
        judge_shard_manifest(manifest, layout, rank, rank, step, model)
        crcs = manifest.meta.get("crc32")
        if not isinstance(crcs, list) or len(crcs) != manifest.n_chunks:
            raise TransferError(f"the manifest lists {_count(crcs)} checksums for {manifest.n_chunks} chunks")
        if os.fstat(f.fileno()).st_size != HEADER.size + length + manifest.total_bytes:
            raise TransferError(f"the file does not hold the {manifest.total_bytes} bytes its manifest says")
        check_allocation(manifest, into, 4 * manifest.total_bytes + CHUNK_BYTES * 2)
        digest = DIGESTS["crc32"][1]
        body = f.tell()
        for i in range(manifest.n_chunks):  # every checksum first: nothing is loaded from a corrupt file
            start, end = manifest.chunk_span(i)
            if digest(memoryview(f.read(end - start))).hex() != crcs[i]:
                raise TransferError(f"chunk {i} of the file fails its crc32", hint="the file is corrupt")
        f.seek(body)
        state, tensors = materialize(manifest, into)
        cmap = ChunkMap(manifest, tensors)
        for i in range(manifest.n_chunks):
            start, end = manifest.chunk_span(i)
            cmap.scatter(i, torch.frombuffer(bytearray(f.read(end - start)), dtype=torch.uint8))
    load_local_state(model, optimizer, state)
    return dict(manifest.meta)


def _count(value: Any) -> int:
    return len(value) if isinstance(value, list) else 0
