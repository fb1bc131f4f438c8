"""A receiver refuses shards that are not its own before it writes one byte: one real FSDP2
rank (a 1-rank gloo group in this process), a donor thread that lies in the manifest's
shard metadata, a socket pair between them."""

from __future__ import annotations

import copy
import datetime
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from torchpass_slurm.errors import NoReplicaError, TransferError
from torchpass_slurm.mesh import MeshLayout
from torchpass_slurm.rank.handover import Agreement, plan_donors
from torchpass_slurm.rank.shard_state import judge_shard_manifest, local_state, shard_meta
from torchpass_slurm.transfer import SocketTransport, recv_state, send_state

from ..gloo_ranks import loopback_store
from .ranks import build

TIMEOUT = datetime.timedelta(seconds=20)
LAYOUT = MeshLayout(("shard",), (1,), replicate=None)
STEP = 4


@pytest.fixture
def fsdp_rank() -> Iterator[tuple[Any, Any]]:
    from torch.distributed.device_mesh import init_device_mesh

    with loopback_store() as port:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, use_libuv=False)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        mesh = init_device_mesh("cpu", LAYOUT.shape, mesh_dim_names=LAYOUT.dims)
        yield build(mesh)


def _mesh(meta: dict[str, Any]) -> None:
    meta["shards"]["mesh"] = {"dims": ["replicate", "shard"], "shape": [2, 2], "replicate": "replicate"}


def _placements(meta: dict[str, Any]) -> None:
    meta["shards"]["specs"]["/model/0.weight"]["placements"] = ["Replicate()"]


def _global_shape(meta: dict[str, Any]) -> None:
    meta["shards"]["specs"]["/optim/state/2.weight/exp_avg"]["global_shape"] = [12, 16]


def _coord(meta: dict[str, Any]) -> None:
    meta["shards"]["rank"] = 3


def _no_shards(meta: dict[str, Any]) -> None:
    del meta["shards"]


def _step(meta: dict[str, Any]) -> None:
    meta["step"] = STEP - 1


@pytest.mark.parametrize(
    ("lie", "said"),
    [
        (_mesh, "shards of the mesh"),
        (_placements, "does not hold this rank's shard at /model/0.weight"),
        (_global_shape, "does not hold this rank's shard at /optim/state/2.weight/exp_avg"),
        (_coord, "say rank 3"),
        (_no_shards, "no shard metadata"),
        (_step, "the agreed step is 4"),
    ],
    ids=["mesh", "placements", "global-shape", "coordinate", "no-metadata", "step"],
)
def test_the_receiver_refuses_shard_metadata_unlike_its_own_before_loading_anything(
    fsdp_rank: tuple[Any, Any], lie: Callable[[dict[str, Any]], None], said: str
) -> None:
    model, optimizer = fsdp_rank
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()  # an optimizer state to send
    state, specs = local_state(model, optimizer)
    before = {k: v.clone() for k, v in state["model"].items()}
    sent = {"model": {k: v + 1 for k, v in state["model"].items()}, "optim": copy.deepcopy(state["optim"])}
    meta = shard_meta(LAYOUT, 0, STEP, specs)
    lie(meta)
    a, b = socket.socketpair()
    donor_error: list[BaseException] = []

    def donor() -> None:
        try:
            send_state(SocketTransport(a), sent, timeout=TIMEOUT, meta=meta)
        except TransferError as exc:
            donor_error.append(exc)

    thread = threading.Thread(target=donor)
    thread.start()
    into, _ = local_state(model, optimizer)
    with pytest.raises(TransferError, match=said):
        recv_state(
            SocketTransport(b),
            timeout=TIMEOUT,
            into=into,
            accept=lambda m: judge_shard_manifest(m, LAYOUT, 0, 0, STEP, model),
        )
    thread.join(20)
    assert donor_error and "rejected" in str(donor_error[0])
    after, _ = local_state(model, optimizer)
    assert all(torch.equal(after["model"][k], before[k]) for k in before)  # nothing was written


def test_the_truthful_manifest_is_accepted(fsdp_rank: tuple[Any, Any]) -> None:
    model, optimizer = fsdp_rank
    state, specs = local_state(model, optimizer)
    a, b = socket.socketpair()
    thread = threading.Thread(
        target=send_state,
        args=(SocketTransport(a), state),
        kwargs={"timeout": TIMEOUT, "meta": shard_meta(LAYOUT, 0, STEP, specs)},
    )
    thread.start()
    _, stats = recv_state(
        SocketTransport(b),
        timeout=TIMEOUT,
        accept=lambda m: judge_shard_manifest(m, LAYOUT, 0, 0, STEP, model),
    )
    thread.join(20)
    params = sum(p.numel() * 4 for p in state["model"].values())
    # torch 2.13's get_optimizer_state_dict creates a fresh AdamW's state (a step with zero
    # gradients and lr 0): two moments per parameter and four float32 step counters
    assert stats.bytes == 3 * params + 4 * 4


HSDP = MeshLayout(("replicate", "shard"), (2, 2))


@pytest.mark.parametrize(
    ("layout", "held", "leaving", "plan"),
    [
        (HSDP, (4, -1, 4, 4), (), {1: 3}),  # rank 1's replica is rank 3
        (HSDP, (-1, 4, 4, 4), (), {0: 2}),
        (MeshLayout(("replicate",), (3,)), (4, 4, -1), (), {2: 1}),  # DDP: rank 0 only as the last choice
        (MeshLayout(("shard",), (4,), replicate=None), (4, -1, 4, 4), (1,), {1: 1}),  # drained: itself
        (HSDP, (4, -1, 4, 4), (1,), {1: 1}),  # a drain prefers the leaving rank to a replica
        (MeshLayout(("shard",), (4,), replicate=None), (4, -1, 4, 4), (), {}),  # nobody: no replica
        (HSDP, (4, -1, 4, -1), (), {}),  # both replicas of shard 1 lost
    ],
    ids=["hsdp", "hsdp-rank0", "ddp", "fsdp-drain", "hsdp-drain", "fsdp-lost", "shard-lost"],
)
def test_donors(
    layout: MeshLayout, held: tuple[int, ...], leaving: tuple[int, ...], plan: dict[int, int]
) -> None:
    assert plan_donors(layout, Agreement(max(held), held, frozenset(leaving))) == plan


def test_no_replica_is_its_own_error() -> None:
    assert not issubclass(NoReplicaError, TransferError)  # not a failed collective: no next epoch helps
