"""A shard checkpoint carries its rank's own state (a data loader position) beside its shards,
checked before it is loaded: one real FSDP2 rank (a 1-rank gloo group in this process)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from torchpass_slurm.errors import CheckpointError
from torchpass_slurm.mesh import MeshLayout
from torchpass_slurm.rank import shard_checkpoint

from ..gloo_ranks import loopback_store
from .ranks import build

LAYOUT = MeshLayout(("shard",), (1,), replicate=None)


class Position:
    def __init__(self, position: int = 0) -> None:
        self.position = position

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])


@pytest.fixture
def mesh() -> Iterator[Any]:
    from torch.distributed.device_mesh import init_device_mesh

    with loopback_store() as port:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, use_libuv=False)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        yield init_device_mesh("cpu", LAYOUT.shape, mesh_dim_names=LAYOUT.dims)


def test_the_rank_state_comes_back_with_the_shards(mesh: Any, tmp_path: Path) -> None:
    model, optimizer = build(mesh)
    shard_checkpoint.save(model, optimizer, LAYOUT, tmp_path, 6, rank_state={"data": Position(41)})
    fresh = Position()
    model, optimizer = build(mesh)
    assert shard_checkpoint.load_latest(model, optimizer, LAYOUT, tmp_path, rank_state={"data": fresh}) == 6
    assert fresh.position == 41


def test_a_checkpoint_without_the_rank_state_asked_for_is_refused(mesh: Any, tmp_path: Path) -> None:
    model, optimizer = build(mesh)
    shard_checkpoint.save(model, optimizer, LAYOUT, tmp_path, 2)
    with pytest.raises(CheckpointError, match="written without rank_state"):
        shard_checkpoint.load_latest(model, optimizer, LAYOUT, tmp_path, rank_state={"data": Position()})


def test_a_rank_state_missing_a_name_is_refused(mesh: Any, tmp_path: Path) -> None:
    model, optimizer = build(mesh)
    shard_checkpoint.save(model, optimizer, LAYOUT, tmp_path, 2, rank_state={"data": Position(3)})
    wanted = {"data": Position(), "rng": Position()}
    with pytest.raises(CheckpointError, match=r"has no \['rng'\]"):
        shard_checkpoint.load_latest(model, optimizer, LAYOUT, tmp_path, rank_state=wanted)
    assert wanted["data"].position == 0  # nothing loaded from a checkpoint that does not fit


def test_a_rank_state_that_is_not_small_json_is_not_saved(mesh: Any, tmp_path: Path) -> None:
    class Huge(Position):
        def state_dict(self) -> dict[str, Any]:
            return {"ids": list(range(20_000))}

    model, optimizer = build(mesh)
    with pytest.raises(CheckpointError, match="the limit is"):
        shard_checkpoint.save(model, optimizer, LAYOUT, tmp_path, 2, rank_state={"data": Huge()})
    assert json.dumps(sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))) == "[]"
