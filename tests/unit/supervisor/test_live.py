"""Recovery when the ranks run ElasticTrainer: live migration, regroup, and when it falls back to a restart.

The rank side is :class:`~.fakes.ElasticRanks`: it reports ``live_ready``,
``collective_failed`` and the replies to ``reconfigure`` and a live
``promote`` (docs/protocol.md, "Recovery"). The supervisor has a rendezvous
store, as under ``tp run`` with torch on the batch host.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from torchpass_slurm.control import messages as msg
from torchpass_slurm.rundir import events as ev
from torchpass_slurm.supervisor.loop import RunState
from torchpass_slurm.supervisor.workers import master_port

from .conftest import CONFIG, JOB_ID, TRAIN_S, Harness, Live, at_of, sent
from .fakes import GLOO_RESET, ElasticRanks


def states(h: Harness) -> list[tuple[float, RunState]]:
    """Records the supervisor's state at every poll: (elapsed, state) on each change."""
    seen: list[tuple[float, RunState]] = []

    def record() -> None:
        if not seen or seen[-1][1] != h.supervisor.state:
            seen.append((h.clock.elapsed, h.supervisor.state))

    h.server.on_poll.insert(0, record)
    return seen


@pytest.mark.parametrize("ntasks", [1, 2])
def test_a_silent_node_migrates_live_to_the_spare_without_relaunching_anyone(live: Live, ntasks: int) -> None:
    h, ranks = live(ntasks=ntasks)
    seen = states(h)
    h.world.go_silent("c2", at=3.0)  # the node dies
    ranks.fail_collective("c1", at=3.5)  # c1's all-reduce fails; every rank stops at step 3

    result = h.run()

    assert (result.state, result.exit_code, result.epoch, result.restarts) == (RunState.SUCCEEDED, 0, 1, 0)
    assert len(h.slurm.launches) == 4  # survivors kept their processes; no new srun step
    assert h.launcher.stops[0] == (["c2"], CONFIG.lost_stop_timeout)
    m = h.supervisor.membership
    assert (m.active, m.spares, m.failed) == (("c1", "c4", "c3"), (), ("c2",))
    assert all(h.supervisor.steps[n].live for n in ("c1", "c3", "c4"))

    (lost,) = h.of_kind(ev.HEARTBEAT_LOST)
    assert (lost.fields["node"], lost.fields["detector"]) == ("c2", "heartbeat_lost")
    assert "while rank 0 on c1: a collective failed" in lost.fields["detail"]
    assert at_of(h, lost) >= 3.5 + CONFIG.fault_settle  # blamed after the settle, not at the report
    (started,) = h.of_kind(ev.MIGRATION_STARTED)
    assert started.epoch == 1
    assert {k: started.fields[k] for k in ("failed", "spares", "committed_step", "mode")} == {
        "failed": ["c2"],
        "spares": ["c4"],
        "committed_step": 3,
        "mode": "live",
    }
    (promoted,) = h.of_kind(ev.SPARE_PROMOTED)
    assert (promoted.epoch, promoted.fields) == (
        1,
        {"node": "c4", "replaces": "c2", "ranks": list(range(ntasks, 2 * ntasks)), "mode": "live"},
    )

    reconfigure = {"epoch": 1, "world_size": 3 * ntasks, "store_addr": "c1", "store_port": 29400}
    assert sent(h, msg.RECONFIGURE) == [
        (f"{n}/{i}", reconfigure) for n in ("c1", "c3") for i in range(ntasks)
    ]
    assert h.promotes() == [
        {
            "to": f"c4/{i}",
            "rank": ntasks + i,
            "local_rank": i,
            "world_size": 3 * ntasks,
            "master_addr": "c1",
            "master_port": master_port(JOB_ID, 1),
            "epoch": 1,
            "mode": "live",
            "store_addr": "c1",
            "store_port": 29400,
        }
        for i in range(ntasks)
    ]

    kinds = h.kinds()
    rank_side = [ev.GROUP_REBUILT, ev.AGREEMENT, ev.TRANSFER_DONE, ev.FIRST_STEP]
    assert [k for k in kinds if k in (ev.MIGRATION_STARTED, *rank_side, ev.MIGRATION_DONE)] == [
        ev.MIGRATION_STARTED,
        *[ev.GROUP_REBUILT] * (2 * ntasks),
        ev.AGREEMENT,
        *[ev.TRANSFER_DONE] * ntasks,
        ev.FIRST_STEP,
        ev.MIGRATION_DONE,
    ]
    (agreement,) = h.of_kind(ev.AGREEMENT)
    assert (agreement.epoch, agreement.fields["node"], agreement.fields["committed_step"]) == (1, "c1", 3)
    assert all(e.epoch == 1 for e in h.events() if e.kind in rank_side)
    (done,) = h.of_kind(ev.MIGRATION_DONE)
    assert {k: done.fields[k] for k in ("resolution", "lost_steps", "recomputed_steps", "failed")} == {
        "resolution": "live",
        "lost_steps": 0,
        "recomputed_steps": 1,
        "failed": ["c2"],
    }
    assert done.fields["seconds"] == pytest.approx(at_of(h, done) - at_of(h, started))
    assert kinds[-1] == ev.FINISHED and ev.RESTARTED not in kinds
    # the dead node left the job (else the job's end waits until Slurm declares it DOWN)
    assert h.slurm.shrinks == [["c1", "c3", "c4"]]
    (released,) = h.of_kind(ev.NODE_RELEASED)
    assert released.fields == {"node": "c2", "released": True, "reason": "lost"}
    assert kinds.index(ev.NODE_RELEASED) > kinds.index(ev.MIGRATION_STARTED)

    # RECOVERING from the decision until the first step of epoch 1, then RUNNING again
    recovering = [t for t, s in seen if s == RunState.RECOVERING]
    back = [t for t, s in seen if s == RunState.RUNNING and recovering and t > recovering[0]]
    assert recovering and back, seen
    assert at_of(h, started) <= recovering[0] < back[0]
    assert back[0] >= at_of(h, h.of_kind(ev.FIRST_STEP)[0])


def test_lost_steps_are_those_the_survivors_reported_beyond_the_agreed_step(live: Live) -> None:
    h, ranks = live(agreed_lag=2)
    h.world.go_silent("c2", at=3.0)
    ranks.fail_collective("c1", at=3.5)

    h.run()

    (agreement,) = h.of_kind(ev.AGREEMENT)
    assert agreement.fields["committed_step"] == 1
    (done,) = h.of_kind(ev.MIGRATION_DONE)
    assert (done.fields["resolution"], done.fields["lost_steps"]) == ("live", 2)


def test_a_survivor_without_the_elastic_loop_forces_a_restart(live: Live) -> None:
    h, ranks = live(elastic={"c1", "c2", "c4"})  # c3 never says live_ready
    h.world.go_silent("c2", at=3.0)
    ranks.fail_collective("c1", at=3.5)
    h.world.report("c1", "resumed", at=10.0, step=1, epoch=1)  # rank 0 of the relaunched c1

    result = h.run()

    assert (result.state, result.epoch, result.restarts) == (RunState.SUCCEEDED, 1, 1)
    assert not h.supervisor.steps["c3"].live
    assert h.launches()[4:] == [("c1", "active", 1), ("c3", "active", 1)]
    assert sent(h, msg.RECONFIGURE) == []
    assert [p["mode"] for p in h.promotes()] == ["restart"]
    (started,) = h.of_kind(ev.MIGRATION_STARTED)
    assert (started.fields["mode"], started.fields["committed_step"]) == ("restart", 3)
    (done,) = h.of_kind(ev.MIGRATION_DONE)
    assert done.epoch == 1
    assert {
        k: done.fields[k] for k in ("resolution", "lost_steps", "recomputed_steps", "resumed_step", "failed")
    } == {
        "resolution": "checkpoint",
        "lost_steps": 2,
        "recomputed_steps": 2,
        "resumed_step": 1,
        "failed": ["c2"],
    }


def test_a_resumed_report_of_an_older_epoch_does_not_close_the_restart(live: Live) -> None:
    h, ranks = live(recovery="restart")
    h.world.go_silent("c2", at=3.0)
    ranks.fail_collective("c1", at=3.5)
    h.world.report("c1", "resumed", at=10.0, step=1, epoch=0)

    h.run()

    assert h.of_kind(ev.MIGRATION_DONE) == []


def test_recovery_restart_restarts_even_when_every_rank_is_live(live: Live) -> None:
    h, ranks = live(recovery="restart")
    h.world.go_silent("c2", at=3.0)
    ranks.fail_collective("c1", at=3.5)

    result = h.run()

    assert (result.state, result.epoch, result.restarts) == (RunState.SUCCEEDED, 1, 1)
    assert all(h.supervisor.steps[n].live for n in ("c1", "c3"))
    assert h.launches()[4:] == [("c1", "active", 1), ("c3", "active", 1)]
    assert sent(h, msg.RECONFIGURE) == []
    assert [(p["mode"], p["store_addr"], p["store_port"]) for p in h.promotes()] == [("restart", "c1", 29400)]
    assert [e.fields["mode"] for e in h.of_kind(ev.MIGRATION_STARTED)] == ["restart"]
    assert ev.RESTARTED in h.kinds()


def test_a_failed_collective_with_nobody_lost_regroups_the_same_ranks(live: Live) -> None:
    h, ranks = live()
    ranks.fail_collective("c1", at=3.5)  # a transient error: every node keeps talking

    result = h.run()

    assert (result.state, result.epoch, result.restarts) == (RunState.SUCCEEDED, 1, 0)
    assert len(h.slurm.launches) == 4
    m = h.supervisor.membership
    assert (m.epoch, m.active, m.spares, m.failed) == (1, ("c1", "c2", "c3"), ("c4",), ())
    assert h.promotes() == []
    reconfigure = {"epoch": 1, "world_size": 3, "store_addr": "c1", "store_port": 29400}
    assert sent(h, msg.RECONFIGURE) == [(f"{n}/0", reconfigure) for n in ("c1", "c2", "c3")]
    assert h.of_kind(ev.HEARTBEAT_LOST) == h.of_kind(ev.SPARE_PROMOTED) == []
    (started,) = h.of_kind(ev.MIGRATION_STARTED)
    assert started.epoch == 1
    assert {k: started.fields[k] for k in ("failed", "spares", "committed_step")} == {
        "failed": [],
        "spares": [],
        "committed_step": None,
    }
    assert "a collective failed" in started.fields["detail"]
    (first,) = h.of_kind(ev.FIRST_STEP)
    (done,) = h.of_kind(ev.MIGRATION_DONE)
    assert at_of(h, done) >= at_of(h, first)
    assert {k: done.fields[k] for k in ("resolution", "lost_steps", "failed")} == {
        "resolution": "regroup",
        "lost_steps": None,
        "failed": [],
    }


def test_two_faults_in_a_row_migrate_live_twice(live: Live) -> None:
    h, ranks = live(spares=2)
    h.world.go_silent("c2", at=3.0)
    ranks.fail_collective("c1", at=3.5)
    h.world.go_silent("c3", at=12.0)
    ranks.fail_collective("c4", at=12.5)  # the promoted spare is a survivor now

    result = h.run()

    assert (result.state, result.epoch, result.restarts) == (RunState.SUCCEEDED, 2, 0)
    assert len(h.slurm.launches) == 5
    m = h.supervisor.membership
    assert (m.active, m.spares, m.failed) == (("c1", "c4", "c5"), (), ("c2", "c3"))
    assert [
        (e.epoch, e.fields["failed"], e.fields["spares"], e.fields["mode"])
        for e in h.of_kind(ev.MIGRATION_STARTED)
    ] == [(1, ["c2"], ["c4"], "live"), (2, ["c3"], ["c5"], "live")]
    assert [(b["epoch"], to) for to, b in sent(h, msg.RECONFIGURE)] == [
        (1, "c1/0"),
        (1, "c3/0"),
        (2, "c1/0"),
        (2, "c4/0"),
    ]
    assert [(p["to"], p["rank"], p["epoch"], p["mode"]) for p in h.promotes()] == [
        ("c4/0", 1, 1, "live"),
        ("c5/0", 2, 2, "live"),
    ]
    assert [(e.epoch, e.fields["committed_step"]) for e in h.of_kind(ev.AGREEMENT)] == [(1, 3), (2, 12)]
    assert [
        (e.fields["resolution"], e.fields["failed"], e.fields["lost_steps"])
        for e in h.of_kind(ev.MIGRATION_DONE)
    ] == [("live", ["c2"], 0), ("live", ["c3"], 0)]


@pytest.mark.parametrize(("epoch", "regroups"), [(0, False), (1, True)])
def test_a_collective_failed_of_an_older_epoch_is_ignored(live: Live, epoch: int, regroups: bool) -> None:
    h, ranks = live()
    h.world.go_silent("c2", at=3.0)
    ranks.fail_collective("c1", at=3.5)
    # long after the migration to epoch 1: a report from c3's old group (or, as a control, its new one)
    h.world.report("c3", "collective_failed", at=12.0, step=3, error=GLOO_RESET, epoch=epoch)

    result = h.run()

    assert result.state == RunState.SUCCEEDED
    assert result.epoch == (2 if regroups else 1)
    assert len(h.of_kind(ev.MIGRATION_STARTED)) == (2 if regroups else 1)


def test_a_spare_that_dies_during_its_migration_is_replaced_by_the_next(live: Live) -> None:
    h, ranks = live(spares=2)
    ranks.stall.add(1)  # the agreement of epoch 1 never comes: c4 dies first
    h.world.go_silent("c2", at=3.0)
    ranks.fail_collective("c1", at=3.5)
    h.world.crash("c4", 1, at=8.0)
    h.world.report("c1", "collective_failed", at=8.5, step=3, error=GLOO_RESET, epoch=1)

    result = h.run()

    assert (result.state, result.epoch, result.restarts) == (RunState.SUCCEEDED, 2, 0)
    # c4's process exited on a node Slurm calls usable: once the recovery is over, c4 is
    # back in the pool (a sixth launch: its standby step)
    assert len(h.slurm.launches) == 6 and h.slurm.launches[-1].node == "c4"
    m = h.supervisor.membership
    assert (m.active, m.spares, m.failed) == (("c1", "c5", "c3"), ("c4",), ("c2",))
    assert [(e.fields["node"], e.fields["returned"]) for e in h.of_kind(ev.SPARE_ADDED)] == [("c4", True)]
    (crashed,) = [e for e in h.of_kind(ev.STEP_EXITED) if e.fields["exit_code"] != 0]
    assert (crashed.fields["node"], crashed.fields["role"]) == ("c4", "active")
    assert [
        (e.epoch, e.fields["failed"], e.fields["spares"], e.fields["mode"])
        for e in h.of_kind(ev.MIGRATION_STARTED)
    ] == [(1, ["c2"], ["c4"], "live"), (2, ["c4"], ["c5"], "live")]
    assert [(p["to"], p["rank"], p["epoch"], p["mode"]) for p in h.promotes()] == [
        ("c4/0", 1, 1, "live"),
        ("c5/0", 1, 2, "live"),
    ]
    assert [(b["epoch"], to) for to, b in sent(h, msg.RECONFIGURE)] == [
        (1, "c1/0"),
        (1, "c3/0"),
        (2, "c1/0"),
        (2, "c3/0"),
    ]
    (done,) = h.of_kind(ev.MIGRATION_DONE)
    assert (done.epoch, done.fields["resolution"], done.fields["lost_steps"]) == (2, "live", 0)


def test_without_a_store_a_live_fault_takes_the_restart_path(make: Callable[..., Harness]) -> None:
    h = make(train_s=TRAIN_S)  # no rendezvous store (no torch on the batch host)
    ranks = ElasticRanks(h.world)
    h.world.go_silent("c2", at=3.0)
    ranks.fail_collective("c1", at=3.5)

    result = h.run()

    assert (result.state, result.restarts) == (RunState.SUCCEEDED, 1)
    assert sent(h, msg.RECONFIGURE) == []
    assert [e.fields["mode"] for e in h.of_kind(ev.MIGRATION_STARTED)] == ["restart"]


def test_a_failed_collective_regroups_even_when_the_settle_blames_only_a_spare(live: Live) -> None:
    h, ranks = live(spares=2)
    h.world.go_silent("c4", at=3.0)  # a spare dies (it is in no process group)...
    ranks.fail_collective("c1", at=3.5)  # ...while the active ranks see a transient error

    h.run()

    assert [e.fields["node"] for e in h.of_kind(ev.SPARE_LOST)] == ["c4"]
    assert sorted(to for to, _ in sent(h, msg.RECONFIGURE)) == ["c1/0", "c2/0", "c3/0"]
    assert [e.fields["resolution"] for e in h.of_kind(ev.MIGRATION_DONE)] == ["regroup"]


def test_a_crash_with_no_spare_left_moves_the_rank_live_onto_its_own_node(live: Live) -> None:
    """Issue 24: c2's process dies, its node lives, no spare is left. The node is its own spare:
    once the old step has ended a standby step starts there and is promoted live, the state comes
    from a replica, and no step is computed again (a restart in place went back to the
    checkpoint)."""
    h, ranks = live(spares=0)
    h.world.crash("c2", 137, at=4.0)
    ranks.fail_collective("c1", at=4.2)

    result = h.run()

    assert (result.state, result.exit_code, result.restarts) == (RunState.SUCCEEDED, 0, 0)
    (started,) = h.of_kind(ev.MIGRATION_STARTED)
    assert [started.fields[k] for k in ("failed", "spares", "mode")] == [["c2"], ["c2"], "live"]
    (promoted,) = h.of_kind(ev.SPARE_PROMOTED)
    assert [promoted.fields[k] for k in ("node", "replaces", "in_place")] == ["c2", "c2", True]
    assert h.launches()[3:] == [("c2", "spare", 1)]  # a standby on c2, after the three first steps
    assert not h.of_kind(ev.RESTARTED)
    (done,) = h.of_kind(ev.MIGRATION_DONE)
    assert done.fields["resolution"] == "live" and done.fields["lost_steps"] == 0
    m = h.supervisor.membership
    assert (m.epoch, m.active, m.spares, m.failed) == (1, ("c1", "c2", "c3"), (), ())
    assert h.supervisor.job.in_place_moves == 1
