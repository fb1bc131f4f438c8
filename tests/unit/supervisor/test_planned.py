"""Planned migration (an admin drain) and pre-emptive migration (a health warning): the node
hands over and leaves.

The rank side is :class:`~.fakes.ElasticRanks`: the ranks of the drained
node report ``released`` and their step exits 0; the others rebuild the group
with the promoted spare, which receives the state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchpass_slurm.analysis.report import analyse
from torchpass_slurm.control import messages as msg
from torchpass_slurm.rundir import events as ev
from torchpass_slurm.supervisor.loop import RunState

from .conftest import CONFIG, JOB_ID, STORE, TRAIN_S, Harness, Live, at_of, sent
from .fakes import ElasticRanks

DRAIN_REASON = "firmware update"


def test_a_drained_node_hands_over_to_the_spare_at_a_step_boundary_and_leaves_the_job(live: Live) -> None:
    h, _ = live(ntasks=2)
    h.world.at(3.0, lambda: h.slurm.set_node("c2", "MIXED", "DRAIN", reason=DRAIN_REASON))

    result = h.run()

    assert (result.state, result.exit_code, result.epoch, result.restarts) == (RunState.SUCCEEDED, 0, 1, 0)
    assert len(h.slurm.launches) == 4  # nobody relaunched
    m = h.supervisor.membership
    assert (m.active, m.spares, m.failed) == (("c1", "c4", "c3"), (), ("c2",))
    (seen,) = h.of_kind(ev.DRAIN_SEEN)
    assert seen.fields == {"node": "c2", "reason": DRAIN_REASON}
    (started,) = h.of_kind(ev.MIGRATION_STARTED)
    assert started.epoch == 1 and at_of(h, started) >= at_of(h, seen)
    assert {k: started.fields[k] for k in ("failed", "spares", "mode", "reason")} == {
        "failed": ["c2"],
        "spares": ["c4"],
        "mode": "planned",
        "reason": DRAIN_REASON,
    }
    # the switch is announced ahead: a step each virtual second, so the lead of
    # CONFIG.switch_lead (1 s) is one step, plus one
    assert started.fields["switch_after"] == started.fields["committed_step"] + 2
    # every rank of epoch 0 is told; the drained node's ranks (2, 3) are told to leave
    planned = {
        "epoch": 1,
        "world_size": 6,
        "store_addr": "c1",
        "store_port": 29400,
        "planned": True,
        "leave": [2, 3],
        "switch_after": started.fields["switch_after"],
    }
    assert sent(h, msg.RECONFIGURE) == [(f"{n}/{i}", planned) for n in ("c1", "c2", "c3") for i in range(2)]
    assert [(p["to"], p["rank"], p["mode"]) for p in h.promotes()] == [
        ("c4/0", 2, "live"),
        ("c4/1", 3, "live"),
    ]
    assert [e.fields["rank"] for e in h.of_kind("released")] == [2, 3]
    (released,) = h.of_kind(ev.NODE_RELEASED)
    assert released.fields == {"node": "c2", "released": True, "reason": "drained"}
    assert h.slurm.shrinks == [["c1", "c3", "c4"]]
    (done,) = h.of_kind(ev.MIGRATION_DONE)
    assert {
        k: done.fields[k] for k in ("resolution", "planned", "lost_steps", "recomputed_steps", "failed")
    } == {"resolution": "live", "planned": True, "lost_steps": 0, "recomputed_steps": 0, "failed": ["c2"]}
    assert h.stopped_senders() == []  # the drained node's tasks left on their own; no spare left to stop
    assert next(n for n in h.status().nodes if n.node == "c2").role == "released"


def test_a_health_warning_drains_the_node_and_its_drain_moves_it_to_the_spare(live: Live) -> None:
    h, _ = live()
    h.world.report(
        "c3", "health_warning", at=3.0, status="WARNING", summary="GPU 0: 40 corrected ECC errors in 60 s"
    )

    result = h.run()

    assert (result.state, result.epoch, result.restarts) == (RunState.SUCCEEDED, 1, 0)
    reason = "torchpass: pre-emptive: WARNING: GPU 0: 40 corrected ECC errors in 60 s"
    assert h.slurm.drains == [("c3", reason)]
    (warning,) = h.of_kind(ev.HEALTH_WARNING)
    assert warning.fields == {
        "node": "c3",
        "status": "WARNING",
        "summary": "GPU 0: 40 corrected ECC errors in 60 s",
    }
    (seen,) = h.of_kind(ev.DRAIN_SEEN)
    assert seen.fields == {"node": "c3", "reason": reason}
    assert at_of(h, warning) <= at_of(h, seen)
    (started,) = h.of_kind(ev.MIGRATION_STARTED)
    assert (started.fields["mode"], started.fields["failed"], started.fields["reason"]) == (
        "planned",
        ["c3"],
        reason,
    )
    assert h.supervisor.membership.active == ("c1", "c2", "c4")
    assert [e.fields["resolution"] for e in h.of_kind(ev.MIGRATION_DONE)] == ["live"]
    assert h.slurm.shrinks == [["c1", "c2", "c4"]]


def test_a_move_now_gpu_signal_loses_the_node_at_once_and_moves_it_live(live: Live) -> None:
    """A GPU signal that takes the node (XID 79: off the bus) is no drain at a step boundary:
    the node's step is stopped and its state comes from a replica, as for a dead node."""
    h, _ = live()
    summary = "gpu: GPU 0 xid 79 GPU_HAS_FALLEN_OFF_THE_BUS: move now"
    h.world.report("c3", "health_warning", at=3.0, status="CRITICAL", summary=summary, move_now=True)

    result = h.run()

    assert (result.state, result.epoch, result.restarts) == (RunState.SUCCEEDED, 1, 0)
    assert h.slurm.drains == [] and h.of_kind(ev.HEALTH_WARNING) == []
    (lost,) = h.of_kind(ev.GPU_FAILED)
    assert (lost.fields["node"], lost.fields["detector"], lost.fields["evidence"]) == (
        "c3",
        "gpu_failed",
        "health",
    )
    assert lost.fields["detail"] == f"CRITICAL: {summary}"
    (started,) = h.of_kind(ev.MIGRATION_STARTED)
    assert (started.fields["mode"], started.fields["failed"]) == ("live", ["c3"])
    assert at_of(h, started) - at_of(h, lost) < 0.5  # at once: no settle, no step boundary
    assert h.supervisor.membership.active == ("c1", "c2", "c4")
    assert [e.fields["resolution"] for e in h.of_kind(ev.MIGRATION_DONE)] == ["live"]
    assert "c3" not in h.supervisor.membership.spares  # a node whose GPU failed is not given back
    (fault,) = analyse(h.events()).faults  # the report counts it as a fault that struck
    assert (fault.fault_class, fault.detector, fault.resolution) == ("unplanned", "gpu_failed", "live")


def test_a_second_health_warning_of_a_node_that_left_changes_nothing(live: Live) -> None:
    h, _ = live()
    h.world.report("c3", "health_warning", at=3.0, status="WARNING", summary="ECC")
    h.world.report("c3", "health_warning", at=3.05, status="CRITICAL", summary="ECC")

    h.run()

    assert len(h.slurm.drains) == 2  # both came while c3 still held its ranks
    assert len(h.of_kind(ev.DRAIN_SEEN)) == 1 and len(h.of_kind(ev.MIGRATION_STARTED)) == 1


def test_a_drain_of_the_batch_host_is_deferred_to_the_end_of_the_job(live: Live) -> None:
    h, _ = live()
    h.supervisor.batch_host = "c1"
    h.world.at(3.0, lambda: h.slurm.set_node("c1", "MIXED", "DRAIN", reason=DRAIN_REASON))

    result = h.run()

    assert (result.state, result.epoch) == (RunState.SUCCEEDED, 0)
    (deferred,) = h.of_kind(ev.DRAIN_DEFERRED)
    assert (deferred.fields["node"], deferred.fields["reason"]) == ("c1", DRAIN_REASON)
    assert "batch host" in deferred.fields["detail"]
    assert h.of_kind(ev.MIGRATION_STARTED) == [] and sent(h, msg.RECONFIGURE) == []
    assert h.slurm.shrinks == []


def test_a_drain_with_no_spare_is_deferred(live: Live) -> None:
    h, _ = live(spares=0)
    h.world.at(3.0, lambda: h.slurm.set_node("c2", "MIXED", "DRAIN", reason=DRAIN_REASON))

    result = h.run()

    assert result.state == RunState.SUCCEEDED
    (deferred,) = h.of_kind(ev.DRAIN_DEFERRED)
    assert deferred.fields["node"] == "c2" and "no live migration possible" in deferred.fields["detail"]
    assert h.supervisor.membership.active == ("c1", "c2", "c3")


def test_a_drain_without_the_elastic_loop_is_deferred(live: Live) -> None:
    h, _ = live(elastic={"c1", "c3"})  # c2's training has no elastic loop: its state cannot move live
    h.world.at(3.0, lambda: h.slurm.set_node("c2", "MIXED", "DRAIN", reason=DRAIN_REASON))

    h.run()

    assert [e.fields["node"] for e in h.of_kind(ev.DRAIN_DEFERRED)] == ["c2"]
    assert h.promotes() == [] and len(h.slurm.launches) == 4


def test_a_drained_spare_leaves_the_pool_and_the_job(live: Live) -> None:
    h, _ = live(spares=2)
    h.world.at(3.0, lambda: h.slurm.set_node("c4", "MIXED", "DRAIN", reason=DRAIN_REASON))

    result = h.run()

    assert (result.state, result.restarts) == (RunState.SUCCEEDED, 0)
    (lost,) = h.of_kind(ev.SPARE_LOST)
    assert lost.fields == {"node": "c4", "reason": f"drained: {DRAIN_REASON}", "spares_left": 1}
    assert h.server.sent_of(msg.STOP)[0].message.body == {"reason": f"node drained: {DRAIN_REASON}"}
    (released,) = h.of_kind(ev.NODE_RELEASED)
    assert released.fields == {"node": "c4", "released": True, "reason": "drained"}
    assert h.slurm.shrinks == [["c1", "c2", "c3", "c5"]]
    assert h.supervisor.membership.spares == ("c5",)


def test_a_drain_waits_until_a_recovery_in_flight_is_done(live: Live) -> None:
    h, ranks = live(spares=2)
    h.world.go_silent("c2", at=3.0)
    ranks.fail_collective("c1", at=3.5)
    # drained while the live migration of c2 is in flight (it starts after the settle, at 5.5 s)
    h.world.at(6.0, lambda: h.slurm.set_node("c3", "MIXED", "DRAIN", reason=DRAIN_REASON))

    result = h.run()

    assert (result.state, result.epoch) == (RunState.SUCCEEDED, 2)
    first, second = h.of_kind(ev.MIGRATION_STARTED)
    assert (first.fields["mode"], second.fields["mode"]) == ("live", "planned")
    (done_live, done_planned) = h.of_kind(ev.MIGRATION_DONE)
    assert at_of(h, done_live) <= at_of(h, second)
    assert h.supervisor.membership.active == ("c1", "c4", "c5")
    assert JOB_ID == 4242 and done_planned.fields["planned"] is True


def test_a_drain_too_late_for_its_switch_is_closed_deferred_when_the_training_ends(
    make: Callable[..., Harness],
) -> None:
    """The campaign's drains seen in a job's last steps: the ranks finished before any switched,
    and the spare waited for a group that never formed until the recovery stalled."""
    h = make(train_s=TRAIN_S, store=STORE)
    ElasticRanks(h.world, delay=1.5)  # a leaving rank hands over 1.5 s after the announcement
    # seen at the Slurm poll of 19.1 s; the ranks' 20 s of training end at 20.1 s, before any left
    h.world.at(19.0, lambda: h.slurm.set_node("c2", "MIXED", "DRAIN", reason=DRAIN_REASON))

    result = h.run()

    assert (result.state, result.exit_code, result.restarts) == (RunState.SUCCEEDED, 0, 0)
    assert h.of_kind("released") == []  # nobody switched
    (started,) = h.of_kind(ev.MIGRATION_STARTED)
    (done,) = h.of_kind(ev.MIGRATION_DONE)
    assert {
        k: done.fields[k]
        for k in ("resolution", "planned", "lost_steps", "recomputed_steps", "failed", "detail")
    } == {
        "resolution": "deferred",
        "planned": True,
        "lost_steps": 0,
        "recomputed_steps": 0,
        "failed": ["c2"],
        "detail": "the training ended before the switch step",
    }
    assert at_of(h, done) - at_of(h, started) < 3  # not a stalled recovery's 60 s
    assert h.of_kind(ev.FINISHED) and not h.of_kind("recovery_stalled")
    assert h.supervisor.membership.active == ("c1", "c4", "c3")
    assert "c4" in h.launcher.stops[-1][0]  # the promoted spare's step is stopped with the job


def test_a_node_release_that_blocks_for_seconds_declares_nobody_silent(live: Live) -> None:
    """Slurm 22.05 held the shrink of a drained node's release 5-10 s before refusing it ("the
    DB index is being set"); the pass then judged silence before reading the heartbeats that had
    come meanwhile, and declared the just-promoted spare lost (the fault campaign)."""
    h, _ = live(ntasks=2)
    h.world.at(3.0, lambda: h.slurm.set_node("c2", "MIXED", "DRAIN", reason=DRAIN_REASON))
    shrink = h.slurm.shrink_job

    def blocked(job_id: int, keep_nodes: Any) -> None:
        h.clock.advance(CONFIG.heartbeat_timeout + 1.0)  # the loop waits on scontrol meanwhile
        shrink(job_id, keep_nodes)

    h.slurm.shrink_job = blocked  # type: ignore[method-assign]

    result = h.run()

    assert (result.state, result.restarts) == (RunState.SUCCEEDED, 0)
    assert not h.of_kind(ev.HEARTBEAT_LOST) and not h.of_kind(ev.FAILED)
    (released,) = h.of_kind(ev.NODE_RELEASED)
    assert released.fields["node"] == "c2"
