"""A hang is known by lack of progress: the job's step stops moving and the ranks behind are blamed.

Every rank waits for every other in a step's all-reduce, so when the job's
highest step has not moved for max(hang_floor, hang_factor x the median
step), the ranks to blame are those not waiting: the silent ones, else the
ones still computing the step their peers wait in. A rank in ``on_commit``
(a checkpoint write) or a stall of every rank alike is no verdict. The
World's steps advance once a virtual second, so the threshold here is
max(2, 3 x 1) = 3 s.
"""

from __future__ import annotations

import pytest

from torchpass_slurm.control import messages as msg
from torchpass_slurm.faults import Detector
from torchpass_slurm.phase import Phase
from torchpass_slurm.rundir import events as ev
from torchpass_slurm.supervisor.hang import RankView, behind, threshold
from torchpass_slurm.supervisor.loop import POLL_SLICE, RunState
from torchpass_slurm.supervisor.progress import Progress

from .conftest import CONFIG, Harness, Live, at_of
from .test_detection import assert_one_live_migration

PASS = POLL_SLICE.total_seconds() + 1e-6
STEP_S = 1.0  # the World commits one step a virtual second
LIMIT = max(CONFIG.hang_floor, CONFIG.hang_factor * STEP_S)
STALL_AT = 6.0


def stall(h: Harness, phases: dict[str, str], *, at: float, until: float | None = None) -> None:
    """At ``at`` every active node stops committing; each node's heartbeats carry its phase
    (``sync`` unless given); at ``until`` they go on."""

    def hold() -> None:
        for sim in h.world.current.values():
            if sim.role == "active":
                sim.held = sim.step_at(h.world.clock.elapsed)
                h.world.phase[sim.node] = phases.get(sim.node, Phase.SYNC)

    def release() -> None:
        for sim in h.world.current.values():
            sim.held = None
        h.world.phase.clear()

    h.world.at(at, hold)
    if until is not None:
        h.world.at(until, release)


def faults(h: Harness) -> list[ev.Event]:
    return [
        e
        for e in h.events()
        if e.kind in (ev.HEARTBEAT_LOST, ev.RANK_HUNG, ev.STEP_EXITED) and e.fields.get("exit_code") != 0
    ]


@pytest.fixture
def training(live: Live) -> Harness:
    """A live job whose ranks report the loop's phases (``sync`` while they step)."""
    h, _ = live(probe=True)
    h.world.phase.update({n: Phase.SYNC for n in ("c1", "c2", "c3")})
    return h


def test_a_rank_still_computing_while_its_peers_wait_is_hung_after_the_threshold(training: Harness) -> None:
    h = training
    stall(h, {"c2": Phase.COMPUTE}, at=STALL_AT)

    h.run()

    (fault,) = faults(h)
    assert (fault.kind, fault.fields["node"], fault.fields["evidence"]) == (ev.RANK_HUNG, "c2", "progress")
    assert "c2/0 still computing after step" in fault.fields["detail"]
    # from the last advance (the step reached at STALL_AT, heard a pass later), at the checks' pace
    assert STALL_AT + LIMIT - 1.0 <= at_of(h, fault) <= STALL_AT + LIMIT + 3 * PASS
    assert_one_live_migration(h, "c2")


def test_a_frozen_rank_of_a_stalled_job_is_lost_before_the_heartbeat_timeout(training: Harness) -> None:
    h = training  # c2's slurmd answers the probe: nothing but the stall confirms its silence
    stall(h, {}, at=STALL_AT)
    h.world.go_silent("c2", at=STALL_AT + 0.2)

    h.run()

    (fault,) = faults(h)
    assert (fault.kind, fault.fields["node"], fault.fields["evidence"]) == (
        ev.HEARTBEAT_LOST,
        "c2",
        "progress",
    )
    assert at_of(h, fault) < STALL_AT + 0.2 + CONFIG.heartbeat_timeout
    assert_one_live_migration(h, "c2")


@pytest.mark.parametrize(
    ("phases", "why"),
    [
        ({"c1": Phase.HOOK}, "rank 0 writes a checkpoint while the others wait"),
        (
            {"c1": Phase.COMPUTE, "c2": Phase.COMPUTE, "c3": Phase.COMPUTE},
            "every rank alike (a slow file system)",
        ),
        ({"c2": Phase.RECOVERING}, "a rank is in the recovery path"),
        ({"c2": "training"}, "a rank outside the elastic loop"),
    ],
)
def test_a_long_stall_with_nobody_behind_is_no_fault(
    training: Harness, phases: dict[str, str], why: str
) -> None:
    h = training
    stall(h, phases, at=STALL_AT, until=STALL_AT + 3 * LIMIT)

    result = h.run()

    assert (result.state, result.epoch) == (RunState.SUCCEEDED, 0), why
    assert not faults(h) and not h.of_kind(ev.MIGRATION_STARTED), why


def test_a_long_checkpoint_does_not_count_once_the_next_step_has_begun(training: Harness) -> None:
    """Rank 0 writes a checkpoint for three thresholds while its peers wait; then it begins the
    next step while c2 still computes its own, for less than a threshold: nobody is behind."""
    h = training
    stall(h, {"c1": Phase.HOOK}, at=STALL_AT, until=STALL_AT + 3 * LIMIT + LIMIT / 2)
    h.world.at(STALL_AT + 3 * LIMIT, lambda: h.world.phase.update({"c1": Phase.SYNC, "c2": Phase.COMPUTE}))

    result = h.run()

    assert (result.state, result.epoch) == (RunState.SUCCEEDED, 0)
    assert not faults(h) and not h.of_kind(ev.MIGRATION_STARTED)


def test_a_rank_stuck_after_a_checkpoint_is_hung_a_threshold_after_it(training: Harness) -> None:
    h = training
    stall(h, {"c1": Phase.HOOK}, at=STALL_AT)
    h.world.at(STALL_AT + 2 * LIMIT, lambda: h.world.phase.update({"c1": Phase.SYNC, "c2": Phase.COMPUTE}))

    h.run()

    (fault,) = faults(h)
    assert (fault.kind, fault.fields["node"], fault.fields["evidence"]) == (ev.RANK_HUNG, "c2", "progress")
    assert STALL_AT + 3 * LIMIT <= at_of(h, fault) <= STALL_AT + 3 * LIMIT + 3 * PASS
    assert_one_live_migration(h, "c2")


def test_no_verdict_before_the_pace_is_known(training: Harness) -> None:
    h = training
    stall(h, {"c2": Phase.COMPUTE}, at=0.0, until=LIMIT + 3.0)  # stuck from the start: no pace yet

    result = h.run()

    assert result.state == RunState.SUCCEEDED and not faults(h)


# -- the pure judgment -------------------------------------------------------------------


def view(node: str, phase: str, *, step: int = 7, silent: bool = False) -> RankView:
    return RankView(node, f"{node}/0", step, phase, silent)


def test_the_ranks_behind_are_the_silent_ones_else_those_computing_the_step_others_wait_in() -> None:
    sync, compute = Phase.SYNC, Phase.COMPUTE
    assert behind([view("a", sync), view("b", compute), view("c", sync)]) == (
        Detector.RANK_HUNG,
        [view("b", compute)],
    )
    assert behind([view("a", sync), view("b", sync, silent=True), view("c", compute)]) == (
        Detector.HEARTBEAT_LOST,
        [view("b", sync, silent=True)],
    )
    assert behind([view("a", sync, step=8), view("b", sync)]) == (  # b is in its optimizer step
        Detector.RANK_HUNG,
        [view("b", sync)],
    )
    assert behind([view("a", compute, step=8), view("b", sync)]) is None  # a moved on: b is not waiting
    assert behind([view("a", sync, silent=True), view("b", sync, silent=True)]) is None  # we hear nobody
    assert (
        behind([view("a", sync), view("b", Phase.HOOK, silent=True)]) is None
    )  # a checkpoint may hold the GIL
    assert behind([view("a", sync), view("b", sync)]) is None  # all wait: a dead collective, not a hang
    assert behind([]) is None


def test_the_threshold_is_a_multiple_of_the_median_step_with_a_floor() -> None:
    assert threshold(None, 4.0, 2.0) is None
    assert threshold(0.25, 4.0, 2.0) == 2.0
    assert threshold(0.85, 4.0, 2.0) == pytest.approx(3.4)


def test_progress_starts_again_from_a_step_that_went_back() -> None:
    p = Progress()
    for t, step in [(0.0, 10), (1.0, 11), (2.0, 12)]:
        p.observe(t, step)
    p.observe(5.0, 4)  # every rank resumed from the checkpoint of step 4
    assert p.last_advance == 5.0
    p.observe(6.0, 5)
    assert (p.last_advance, p.step_seconds) == (6.0, 1.0)


def test_a_straggler_beat_of_a_restarted_step_does_not_stall_the_recomputed_steps(live: Live) -> None:
    """After a checkpoint restart the new processes recompute steps below the old high mark. A
    last heartbeat of the old process on a node, arriving after the relaunch and before the new
    process's hello, once counted for the new step: its step stood above every recomputed one,
    the job's highest step stopped moving, and the ranks were declared hung (issue 24)."""
    # no spare and --recovery restart: the crash restarts every rank in place from the checkpoint
    h, _ = live(spares=0, recovery="restart")
    h.world.phase.update({n: Phase.SYNC for n in ("c1", "c2", "c3")})
    h.world.crash("c2", 137, at=4.0)
    h.world.at(3.0, lambda: h.world.hello_delay.__setitem__("c1", 2.0))  # its relaunch imports
    straggled: list[float] = []

    def straggle() -> None:
        if len(h.launches()) > 3 and not straggled:  # just relaunched; the new c1 not up yet
            h.server.inject(
                b"c1/0#1", "c1/0", msg.HEARTBEAT, {"rank": 0, "step": 10_000, "state": Phase.SYNC}
            )
            straggled.append(h.clock.elapsed)

    h.server.on_poll.append(straggle)
    result = h.run()

    assert straggled, "the relaunch never happened"
    assert (result.state, result.restarts) == (RunState.SUCCEEDED, 1)
    assert not faults(h)[1:], [e.fields for e in faults(h)]  # the crash, then nothing
    assert h.supervisor.job.steps["c1"].last_step != 10_000
