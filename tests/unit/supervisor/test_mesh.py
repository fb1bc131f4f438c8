"""The job's device mesh decides whether an unplanned loss can be live: a lost rank needs a surviving replica.

Sharded ranks report their :class:`~torchpass_slurm.mesh.MeshLayout` in ``live_ready``
(:class:`~.fakes.ElasticRanks` ``mesh``); a job that reports none is DDP. Four nodes of one
rank each, and one spare::

    HSDP 2x2 ("replicate", "shard")      pure FSDP 1x4 ("shard",)
               shard 0  shard 1
    replica 0  c1 (0)   c2 (1)           c1 (0)  c2 (1)  c3 (2)  c4 (3): nobody has a replica
    replica 1  c3 (2)   c4 (3)
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from torchpass_slurm.analysis.report import analyse
from torchpass_slurm.control import messages as msg
from torchpass_slurm.mesh import MeshLayout
from torchpass_slurm.rundir import events as ev
from torchpass_slurm.supervisor.loop import RunState
from torchpass_slurm.supervisor.plan import NO_REPLICA

from .conftest import Live, sent

HSDP = MeshLayout(("replicate", "shard"), (2, 2)).to_json()
FSDP = MeshLayout(("shard",), (4,), replicate=None).to_json()


def test_hsdp_that_loses_one_node_migrates_live_from_its_replica(live: Live) -> None:
    h, ranks = live(active=4)
    ranks.mesh = HSDP
    h.world.go_silent("c2", at=3.0)  # rank 1; rank 3 (c4) holds the same shard
    ranks.fail_collective("c1", at=3.5)

    result = h.run()

    assert (result.state, result.restarts) == (RunState.SUCCEEDED, 0)
    assert h.supervisor.job.layout == MeshLayout(("replicate", "shard"), (2, 2))
    (layout,) = h.of_kind(ev.MESH_LAYOUT)
    assert {k: layout.fields[k] for k in ("dims", "shape", "replicate")} == HSDP
    (started,) = h.of_kind(ev.MIGRATION_STARTED)
    assert started.fields["mode"] == "live" and "fallback" not in started.fields
    assert [p["mode"] for p in h.promotes()] == ["live"]


def test_pure_fsdp_that_loses_one_node_restarts_from_the_checkpoint_for_want_of_a_replica(live: Live) -> None:
    h, ranks = live(active=4)
    ranks.mesh = FSDP
    h.world.go_silent("c2", at=3.0)
    ranks.fail_collective("c1", at=3.5)
    h.world.report("c1", "resumed", at=12.0, step=1, epoch=1)

    result = h.run()

    assert (result.state, result.epoch, result.restarts) == (RunState.SUCCEEDED, 1, 1)
    assert sent(h, msg.RECONFIGURE) == []
    assert [p["mode"] for p in h.promotes()] == ["restart"]
    (started,) = h.of_kind(ev.MIGRATION_STARTED)
    assert (started.fields["mode"], started.fields["fallback"]) == ("restart", NO_REPLICA)
    assert started.fields["detail"].startswith("no replica: rank(s) 1 lost with every replica")
    assert ev.RESTARTED in h.kinds()
    (fault,) = analyse(h.events()).faults
    assert (fault.node, fault.resolution, fault.fallback) == ("c2", "checkpoint", NO_REPLICA)
    assert fault.as_dict()["fallback"] == NO_REPLICA


def test_pure_fsdp_drained_moves_live_as_planned_the_leaving_rank_sends_its_own_shards(live: Live) -> None:
    h, ranks = live(active=4)
    ranks.mesh = FSDP
    h.world.at(3.0, lambda: h.slurm.set_node("c2", "MIXED", "DRAIN", reason="maintenance"))

    result = h.run()

    assert (result.state, result.restarts) == (RunState.SUCCEEDED, 0)
    (started,) = h.of_kind(ev.MIGRATION_STARTED)
    assert started.fields["mode"] == "planned" and "fallback" not in started.fields
    (done,) = h.of_kind(ev.MIGRATION_DONE)
    assert (done.fields["resolution"], done.fields["planned"]) == ("live", True)


BAD_MESHES: list[Any] = [
    MeshLayout(("replicate", "shard"), (2, 3)).to_json(),  # 6 ranks, the job has 4
    {"dims": ["shard"], "shape": [4], "replicate": None, "extra": 1},  # unknown key
    {"dims": [{"x": 1}], "shape": [4]},  # an unhashable dimension name
    {"dims": ["shard"], "shape": [-4]},
    {"dims": ["shard", "shard"], "shape": [2, 2]},
    {"dims": ["shard"], "shape": [4], "replicate": "replica"},  # not one of the dims
    "replicate",
]


@pytest.mark.parametrize("bad", BAD_MESHES)
def test_a_malformed_or_misfitting_mesh_is_refused_and_nothing_changes(
    live: Live, bad: Any, caplog: pytest.LogCaptureFixture
) -> None:
    h, ranks = live(active=4)
    ranks.mesh_of["c3"] = bad  # the others report no mesh (DDP)

    with caplog.at_level(logging.WARNING, logger="torchpass_slurm.supervisor.loop"):
        result = h.run()

    assert (result.state, result.restarts) == (RunState.SUCCEEDED, 0)
    assert h.supervisor.job.layout is None
    assert not h.supervisor.steps["c3"].live  # its live_ready was refused whole
    assert all(h.supervisor.steps[n].live for n in ("c1", "c2", "c4"))
    assert ev.MESH_LAYOUT not in h.kinds()
    assert any("mesh" in r.getMessage() for r in caplog.records)


def test_a_mesh_that_differs_from_the_one_kept_is_refused(live: Live) -> None:
    h, ranks = live(active=4)
    ranks.mesh = HSDP
    ranks.mesh_of["c4"] = FSDP

    h.run()

    assert h.supervisor.job.layout == MeshLayout.from_json(HSDP)
    assert not h.supervisor.steps["c4"].live
    assert len(h.of_kind(ev.MESH_LAYOUT)) == 1
