"""``RankState``: strict JSON copies within bounds, tagged by step, the last two kept, restored by the
agreed step from this rank's own copies or a promotion's, and a loud failure when none matches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from torchpass_slurm.control.kinds import Kind
from torchpass_slurm.control.rankstate import MAX_RANK_STATE_BYTES
from torchpass_slurm.rank.rankinfo import RankInfo, Role
from torchpass_slurm.rank.rankstate import RankState, RankStateError
from torchpass_slurm.rank.runtime import Runtime

from .loader import ShardLoader


def runtime(role: Role = Role.ACTIVE, rank: int = 1) -> tuple[Runtime, list[tuple[str, dict[str, Any]]]]:
    info = RankInfo(
        rank=rank, world_size=2, local_rank=0, local_world_size=1, master_addr="127.0.0.1", master_port=29500
    )
    rt = Runtime(role, info, environ={})
    reports: list[tuple[str, dict[str, Any]]] = []
    rt.report = lambda event, **fields: reports.append((str(event), fields))  # type: ignore[method-assign]
    return rt, reports


def sent(rt: Runtime) -> list[tuple[str, dict[str, Any]]]:
    out = []
    while not rt.outbox.empty():
        out.append(rt.outbox.get_nowait())
    return out


class Blob:
    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"v": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["v"]


def test_a_capture_is_sent_tagged_and_detached_from_the_live_object() -> None:
    rt, _ = runtime()
    loader = ShardLoader(1, 2)
    rs = RankState(rt, {"data": loader})
    loader.next_batch()
    rs.capture(1)
    loader.next_batch()
    assert sent(rt) == [
        (Kind.RANK_STATE, {"rank": 1, "step": 1, "state": {"data": {"epoch": 0, "position": 2, "seed": 0}}})
    ]
    assert rs.tag == 1


def test_a_plain_rank_keeps_its_copies_but_sends_nothing() -> None:
    rt, _ = runtime(Role.PLAIN)
    rs = RankState(rt, {"data": ShardLoader(1, 2)})
    rs.capture(0)
    assert sent(rt) == [] and rs.tag == 0


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (torch.zeros(2), "Tensor; expected a JSON value"),
        ({1: "int key"}, "keys must be strings"),
        (float("nan"), "must be finite"),
        ({"x": b"bytes"}, "bytes; expected a JSON value"),
        ("x" * (MAX_RANK_STATE_BYTES + 1), "the limit is"),
    ],
)
def test_only_bounded_json_is_captured(value: Any, said: str) -> None:
    rt, _ = runtime()
    rs = RankState(rt, {"blob": Blob(value)})
    with pytest.raises(RankStateError, match=said) as caught:
        rs.capture(3)
    assert "rank_state holds small per-rank positions" in (caught.value.hint or "")
    assert sent(rt) == [] and rs.tag is None


def test_after_a_discarded_step_the_rank_goes_back_to_its_own_copy_of_the_agreed_step() -> None:
    rt, _ = runtime()
    loader = ShardLoader(1, 2)
    rs = RankState(rt, {"data": loader})
    for step in range(4):  # steps 0..3: the batch drawn, then the capture of the forward pre-hook
        loader.next_batch()
        rs.capture(step + 1)
    sent(rt)
    assert [t for t, _ in rs._copies] == [3, 4]  # the last two
    rs.restore(3)  # step 3 never committed: the agreement says 3
    assert loader.state_dict()["position"] == 6 and rs.tag == 3
    assert sent(rt)[0][1]["step"] == 3  # the restored copy is sent again
    rs.restore(3)
    assert sent(rt) == []  # already there: nothing to do


def test_a_step_that_failed_before_its_capture_is_rewound_too() -> None:
    """FSDP2 all-gathers in its own pre-forward hook: a step can fail after its batch was drawn
    and before any capture. The objects are then ahead of their tag; the failure path forgets
    what they hold, so the restore of the agreed step rewinds them."""
    rt, _ = runtime()
    loader = ShardLoader(1, 2)
    rs = RankState(rt, {"data": loader})
    for step in range(3):
        loader.next_batch()
        rs.capture(step + 1)
    loader.next_batch()  # step 3's batch; its collective fails before the capture
    drawn = loader.state_dict()["position"]
    rs.forget_held()
    rs.restore(3)
    assert loader.state_dict()["position"] < drawn and rs.tag == 3
    assert loader.state_dict() == rs._copies[-1][1]["data"]


def test_a_spare_loads_the_promotions_copy_of_the_agreed_step() -> None:
    rt, _ = runtime()
    loader = ShardLoader(1, 2)
    rs = RankState(rt, {"data": loader})
    offered = [
        (6, {"data": {"epoch": 1, "position": 4, "seed": 0}}),
        (7, {"data": {"epoch": 1, "position": 6, "seed": 0}}),
    ]
    rs.restore(6, offered)
    assert loader.state_dict() == {"epoch": 1, "position": 4, "seed": 0}


def test_no_copy_of_the_agreed_step_fails_loudly_and_loads_nothing() -> None:
    rt, reports = runtime()
    loader = ShardLoader(1, 2)
    rs = RankState(rt, {"data": loader})
    stale = [(4, {"data": {"epoch": 0, "position": 8, "seed": 0}})]  # the copy of step 5 never arrived
    with pytest.raises(RankStateError, match="no copy of its rank state of step 5"):
        rs.restore(5, stale)
    assert loader.state_dict()["position"] == 0
    assert reports == [("rank_state_missing", {"step": 5, "tags": [4], "epoch": 0})]


def test_the_rank_state_is_saved_beside_the_training_state_in_a_checkpoint(tmp_path: Path) -> None:
    from torchpass_slurm.rank import checkpoint
    from torchpass_slurm.rank.rankstate import RANK_STATE_KEY

    rt, _ = runtime(Role.PLAIN)
    loader = ShardLoader(1, 2)
    for _ in range(3):
        loader.next_batch()
    model = torch.nn.Linear(2, 2)
    state = {
        "train": checkpoint.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1)),
        RANK_STATE_KEY: RankState(rt, {"data": loader}).checkpoint_entry(),
    }
    checkpoint.save(state, tmp_path, 3)
    fresh = ShardLoader(1, 2)
    again = {
        "train": checkpoint.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1)),
        RANK_STATE_KEY: RankState(rt, {"data": fresh}).checkpoint_entry(),
    }
    assert checkpoint.load_latest(again, tmp_path) == 3
    assert fresh.state_dict() == loader.state_dict()
