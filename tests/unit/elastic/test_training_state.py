"""The one trainer and the one handover, configured by the injected training state: DDP is the
mesh ``("replicate",)`` of the world, and what each adapter reports is what it reported before
the two recovery paths became one (pure checks, no process group)."""

from __future__ import annotations

import datetime
import itertools
from typing import Any

import pytest
from torch import nn

from torchpass_slurm.errors import TorchpassError
from torchpass_slurm.mesh import MeshLayout
from torchpass_slurm.rank.elastic import DEFAULT_DDP_KWARGS, ElasticTrainer
from torchpass_slurm.rank.handover import Agreement, Handover, plan_donors
from torchpass_slurm.rank.replicated import ReplicatedState
from torchpass_slurm.rank.sharded import ShardedState, ShardedTrainer
from torchpass_slurm.train import ShardedTrainer as PublicShardedTrainer

from ..gloo_ranks import loopback_store


class StubRuntime:
    """What constructing a trainer reads of a Runtime: nothing but the object itself."""


def agreement(held: tuple[int, ...], leaving: tuple[int, ...] = ()) -> Agreement:
    return Agreement(max(held), held, frozenset(leaving))


def every_held(world: int) -> list[tuple[int, ...]]:
    """Every committed step a world of ``world`` ranks may hold: each at 5, at 4 or a spare's -1."""
    return list(itertools.product((5, 4, -1), repeat=world))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_ddp_donors_are_the_holders_in_turn_in_rank_order(world: int) -> None:
    """What the DDP handover did before it was the mesh handover: receiver i (in rank order)
    takes donor i % len(donors), the donors being every rank at the agreed step."""
    for held in every_held(world):
        got = agreement(held)
        donors = got.holders
        expected = {recv: donors[i % len(donors)] for i, recv in enumerate(got.receivers)}
        assert plan_donors(MeshLayout.ddp(world), got, avoid=ReplicatedState.avoid) == expected, held


def test_ddp_reports_every_holder_as_a_donor_and_no_transport() -> None:
    ddp = ReplicatedState(nn.Linear(2, 2), None, {})  # type: ignore[arg-type]
    assert ddp.agreement_fields([0, 1], {2: 0}, ()) == {"donors": [0, 1]}
    assert ddp.agreement_fields([0], {}, ()) == {"donors": [0]}  # no receiver: still the holders
    assert ddp.transfer_fields("group") == {}
    assert not ddp.leaving_donor and ddp.resumable
    assert ddp.layout(3) == MeshLayout.ddp(3)


def test_a_sharded_state_reports_the_donors_its_plan_uses_and_the_leaving_ranks() -> None:
    layout = MeshLayout(("replicate", "shard"), (2, 2))
    sharded = ShardedState(StubRuntime(), lambda mesh: (None, None), layout)  # type: ignore[arg-type, return-value]
    got = agreement((5, -1, 5, 5))
    plan = plan_donors(layout, got, avoid=sharded.avoid)
    assert plan == {1: 3}
    assert sharded.agreement_fields(got.holders, plan, got.leaving) == {"donors": [3], "leaving": []}
    assert sharded.agreement_fields([0, 2, 3], {1: 1}, {1}) == {"donors": [1], "leaving": [1]}
    assert sharded.transfer_fields("socket") == {"via": "socket"}
    assert sharded.leaving_donor and not sharded.resumable
    assert sharded.layout(4) is layout


def test_elastic_trainer_is_the_one_trainer_with_a_replicated_state() -> None:
    model = nn.Linear(2, 2)
    trainer = ElasticTrainer(StubRuntime(), model, None, state={"model": model})  # type: ignore[arg-type]
    assert isinstance(trainer.training, ReplicatedState)
    assert trainer.model is model and trainer.ddp_model is model  # no wrap before start()
    assert trainer.ddp_kwargs == dict(DEFAULT_DDP_KWARGS)
    assert trainer.checkpoint_state == {"model": model}


def test_sharded_trainer_is_the_same_trainer_with_a_sharded_state() -> None:
    layout = MeshLayout(("shard",), (2,), replicate=None)
    trainer = ShardedTrainer(StubRuntime(), lambda mesh: (None, None), layout)  # type: ignore[arg-type, return-value]
    assert PublicShardedTrainer is ShardedTrainer
    assert type(trainer) is ElasticTrainer
    assert isinstance(trainer.training, ShardedState)
    assert trainer.ddp_kwargs == {} and trainer.checkpoint_state == {}
    with pytest.raises(TorchpassError, match="needs the process group"):
        trainer.model  # noqa: B018 - the property raises: the model is built at start()


class ReportingRuntime:
    """What a handover without receivers uses of a Runtime: its rank, epoch and reports."""

    rank, epoch = 0, 0

    def __init__(self) -> None:
        self.reports: list[tuple[str, dict[str, Any]]] = []

    def report(self, kind: Any, **fields: Any) -> None:
        self.reports.append((str(kind), fields))


@pytest.mark.parametrize(
    ("leaving_donor", "report"),
    [
        (False, {"committed_step": 4, "receivers": [], "donors": [0], "epoch": 0}),
        (True, {"committed_step": 4, "receivers": [], "donors": [], "leaving": [0], "epoch": 0}),
    ],
)
def test_the_leave_set_reaches_the_agreement_only_where_the_state_serves_itself_on_leaving(
    leaving_donor: bool, report: dict[str, Any]
) -> None:
    """A DDP drain's leaving rank just leaves (a replica serves the spare): the handover drops
    the leave set before the all-gather; a sharded one's is agreed on (one real gloo rank)."""
    import torch.distributed as dist

    layout = MeshLayout(("shard",), (1,), replicate=None)
    training = (
        ShardedState(StubRuntime(), lambda mesh: (None, None), layout)  # type: ignore[arg-type, return-value]
        if leaving_donor
        else ReplicatedState(nn.Linear(2, 2), None, {})
    )  # type: ignore[arg-type]
    rt = ReportingRuntime()
    with loopback_store() as port:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        assert Handover(rt, training).sync(4, leaving=(0,)) == 4  # type: ignore[arg-type]
    assert rt.reports == [("agreement", report)]
