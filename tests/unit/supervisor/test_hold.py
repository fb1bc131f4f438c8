"""No spare at this moment is not the end (issue 24, item 3): the job holds its step for a refill.

c1-c3 active, c4 the spare, the pool refills by job expansion (``FakeSlurm.idle``). The first
loss takes c4; Slurm has no idle node, so the second loss finds no spare: the survivors hold the
committed step while the pool asks, and the move is live once a node comes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from torchpass_slurm.config import SupervisorConfig
from torchpass_slurm.errors import ConfigError
from torchpass_slurm.rundir import events as ev
from torchpass_slurm.supervisor.loop import RunState

from .conftest import CONFIG, Harness, Live, at_of
from .test_refill import wait_thread


def two_losses(h: Harness, ranks: object) -> None:
    h.world.go_silent("c2", at=3.0)
    ranks.fail_collective("c1", at=3.5)  # type: ignore[attr-defined]
    h.world.go_silent("c3", at=9.0)
    ranks.fail_collective("c1", at=9.5)  # type: ignore[attr-defined]


def test_a_loss_with_no_spare_holds_the_step_and_moves_live_when_a_node_comes(live: Live) -> None:
    h, ranks = live(refill=True)
    wait_thread(h)
    two_losses(h, ranks)
    h.world.at(16.0, lambda: h.slurm.idle.append("c5"))  # a node comes free 6 s into the hold
    in_flight: list[int] = []
    h.server.on_poll.append(lambda: in_flight.append(h.supervisor.pool.asking))

    result = h.run()

    assert (result.state, result.exit_code, result.restarts) == (RunState.SUCCEEDED, 0, 0)
    (holding,) = h.of_kind(ev.HOLDING)
    assert holding.fields["failed"] == ["c3"] and holding.fields["wait_s"] == CONFIG.spare_wait
    assert "holding the committed step" in holding.fields["detail"]
    started = h.of_kind(ev.MIGRATION_STARTED)
    assert [(e.fields["failed"], e.fields["spares"], e.fields["mode"]) for e in started] == [
        (["c2"], ["c4"], "live"),
        (["c3"], ["c5"], "live"),
    ]
    assert "held_s" not in started[0].fields
    held_s = started[1].fields["held_s"]  # from the hold to the move, the node's arrival between
    assert held_s == pytest.approx(at_of(h, started[1]) - at_of(h, holding), abs=0.01)
    assert at_of(h, holding) + held_s >= 16.0
    (added,) = h.of_kind(ev.SPARE_ADDED)
    assert added.fields["node"] == "c5" and at_of(h, added) >= 16.0
    assert at_of(h, holding) < at_of(h, added) <= at_of(h, started[1])
    assert [e.fields["node"] for e in h.of_kind(ev.HEARTBEAT_LOST)] == ["c2", "c3"]  # once each
    assert [d.fields["resolution"] for d in h.of_kind(ev.MIGRATION_DONE)] == ["live", "live"]
    m = h.supervisor.membership
    assert (m.active, m.spares, m.failed) == (("c1", "c4", "c5"), (), ("c2", "c3"))
    # a spare for the held loss and one for the pool, asked one after the other, never two at
    # once (two in flight were given the same node on the dev cluster)
    assert max(in_flight) == 1


def test_a_hold_that_no_node_ends_gives_up_after_spare_wait(live: Live) -> None:
    h, ranks = live(refill=True, config=dataclasses.replace(CONFIG, spare_wait=6.0))
    wait_thread(h)
    two_losses(h, ranks)

    result = h.run()

    assert result.state == RunState.FAILED
    (holding,) = h.of_kind(ev.HOLDING)
    (failed,) = h.of_kind(ev.FAILED)
    assert at_of(h, failed) - at_of(h, holding) >= 6.0
    assert "no hot spare left" in failed.fields["message"]
    assert len(h.of_kind(ev.MIGRATION_STARTED)) == 1


def test_without_a_pool_that_can_refill_a_loss_with_no_spare_ends_the_job_at_once(live: Live) -> None:
    h, ranks = live()  # no refill: nothing would ever come
    two_losses(h, ranks)

    result = h.run()

    assert result.state == RunState.FAILED
    assert not h.of_kind(ev.HOLDING)
    (failed,) = h.of_kind(ev.FAILED)
    assert at_of(h, failed) < 9.0 + 5.0  # judged as soon as the loss is: no wait


@pytest.mark.parametrize(("raw", "wait"), [("0", 0.0), ("90", 90.0), ("2.5", 2.5)])
def test_spare_wait_may_be_zero_meaning_never_hold(raw: str, wait: float) -> None:
    assert SupervisorConfig.from_env({"TORCHPASS_SPARE_WAIT": raw}).spare_wait == wait


@pytest.mark.parametrize(
    ("name", "raw", "why"),
    [
        ("TORCHPASS_SPARE_WAIT", "-1", "must be 0 or more"),
        ("TORCHPASS_SPARE_WAIT", "soon", "is not a number of seconds"),
        ("TORCHPASS_REFILL_WAIT", "0", "must be above 0"),
    ],
)
def test_a_bad_wait_is_a_clear_error(name: str, raw: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        SupervisorConfig.from_env({name: raw})


def test_the_status_snapshot_says_what_the_job_holds_for_and_until_when(tmp_path: Path) -> None:
    from torchpass_slurm.faults import Detector, Fault
    from torchpass_slurm.supervisor.membership import Membership
    from torchpass_slurm.supervisor.state import Holding, JobState
    from torchpass_slurm.supervisor.status import job_status

    job = JobState(job_id=7, membership=Membership.initial(["c1", "c2", "c3"], 3, 1))
    assert (job_status(job, tmp_path, 1000.0).holding, job_status(job, tmp_path, 1000.0).holding_until) == (
        (),
        None,
    )
    lost = Fault("c3", Detector.HEARTBEAT_LOST, "c3 silent")
    job.holding = Holding((lost,), since=990.0, until=5.0e6, wait_s=300.0)
    status = job_status(job, tmp_path, 1000.0)
    assert (status.holding, status.holding_until) == (("c3",), 1290.0)


def test_a_loss_during_a_recovery_with_the_pool_empty_holds_then_moves_live(live: Live) -> None:
    """Issue 24, item 5: c2's rank moves to the spare c4; before that recovery is done, c3 goes
    silent too. The pool is empty, a replica (c1) holds the state: the job holds (it neither gives
    up nor falls back to the checkpoint, and the stalled-recovery timeout does not run during the
    hold), and the refill's node takes c3's rank live in the same chain of recoveries."""
    config = dataclasses.replace(CONFIG, recovery_timeout=6.0)
    h, ranks = live(refill=True, probe=True, config=config)
    assert h.probe is not None
    h.probe.gone.update({"c2", "c3"})  # powered off: their slurmd does not answer
    wait_thread(h)
    h.slurm.idle = []
    ranks.stall.add(1)  # the first recovery never reaches its agreement: c3's loss comes mid-way
    h.world.go_silent("c2", at=3.0)
    ranks.fail_collective("c1", at=3.5)
    h.world.go_silent("c3", at=7.0)
    h.world.at(14.0, lambda: h.slurm.idle.append("c5"))  # past the first recovery's timeout

    result = h.run()

    assert (result.state, result.exit_code, result.restarts) == (RunState.SUCCEEDED, 0, 0)
    (holding,) = h.of_kind(ev.HOLDING)
    assert holding.fields["failed"] == ["c3"]
    started = h.of_kind(ev.MIGRATION_STARTED)
    assert [(e.fields["failed"], e.fields["spares"], e.fields["mode"]) for e in started] == [
        (["c2"], ["c4"], "live"),
        (["c3"], ["c5"], "live"),
    ]
    assert started[1].fields["chained_from"] == started[0].epoch
    assert not h.of_kind(ev.RESTARTED)  # no stalled-recovery restart during the hold
    (done,) = h.of_kind(ev.MIGRATION_DONE)
    assert done.fields["resolution"] == "live" and sorted(done.fields["failed"]) == ["c2", "c3"]
    m = h.supervisor.membership
    assert (m.active, m.failed) == (("c1", "c4", "c5"), ("c2", "c3"))


def test_the_node_a_hold_waits_for_a_spare_for_is_never_asked_back_while_it_may_be_dead(live: Live) -> None:
    """The held loss c3 keeps its slot, but its node is lost: Slurm, which has not noticed the
    power cut, calls it idle at once; the pool's request must not take it back (measured: Slurm
    granted the dead node, merged it, then cancelled the job when it set the node down)."""
    h, ranks = live(refill=True)
    wait_thread(h)
    h.slurm.slurmd_timeout = "60 sec"
    h.slurm.started.update({n: h.clock.time() for n in ("c2", "c3")})  # never restarted
    h.slurm.idle = []
    two_losses(h, ranks)
    h.world.at(9.2, lambda: h.slurm.idle.append("c3"))  # idle to Slurm 0.2 s after the cut
    h.world.at(16.0, lambda: h.slurm.idle.append("c5"))

    result = h.run()

    assert (result.state, result.restarts) == (RunState.SUCCEEDED, 0)
    assert h.of_kind(ev.HOLDING)
    assert ("c3",) not in h.slurm.expansions and ("c5",) in h.slurm.expansions
    promoted = [(e.fields["node"], e.fields["replaces"]) for e in h.of_kind(ev.SPARE_PROMOTED)]
    assert promoted == [("c4", "c2"), ("c5", "c3")]
