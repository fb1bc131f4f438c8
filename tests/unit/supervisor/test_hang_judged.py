"""``hang.judged``: whether a job is judged by its progress, as ``views`` would say it, without
building a view of every rank (the check runs ten times a second over 16,384 of them)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from torchpass_slurm.config import NodeRole
from torchpass_slurm.phase import JUDGED, Phase
from torchpass_slurm.supervisor.hang import judged, views
from torchpass_slurm.supervisor.membership import Membership
from torchpass_slurm.supervisor.state import JobState
from torchpass_slurm.supervisor.workers import WorkerState, WorkerStep

from .fakes import FakeProcess, VirtualClock


def job_of(phases: dict[str, str | None]) -> JobState:
    """Two active nodes of two tasks (and a spare), each task heard with its phase (None: heard
    without one, a hello)."""
    job = JobState(job_id=1, membership=Membership.initial(["a", "b", "s"], 2, 2))
    for node in ("a", "b", "s"):
        role = NodeRole.SPARE if node == "s" else NodeRole.ACTIVE
        step = WorkerStep(node, role, 0, 2, FakeProcess(VirtualClock()), 0.0)  # type: ignore[arg-type]
        step.state = WorkerState.STANDBY if node == "s" else WorkerState.RUNNING
        job.launched(node, step)
    for sender, phase in phases.items():
        job.steps[sender.split("/")[0]].seen(sender, 10.0, 3, phase)
    return job


STEADY = {"a/0": Phase.SYNC, "a/1": Phase.COMPUTE, "b/0": Phase.SYNC, "b/1": Phase.SYNC}


def stale_standby_phase(job: JobState) -> None:
    """A promoted spare's heartbeats are cleared, its old phases are not (``orders.py``)."""
    job.steps["b"].phases["b/9"] = (None, Phase.STANDBY)


def not_running(job: JobState) -> None:
    job.steps["b"].state = WorkerState.STARTING


def releasing(job: JobState) -> None:
    job.releasing.add("a")


CASES: list[tuple[str, dict[str, str | None], Callable[[JobState], None] | None, bool]] = [
    ("every rank computes or syncs", STEADY, None, True),
    ("a rank in on_commit", {**STEADY, "b/1": Phase.HOOK}, None, False),
    ("a rank outside the elastic loop", {**STEADY, "a/0": Phase.RUNNING}, None, False),
    ("a rank heard without a phase", {**STEADY, "b/1": None}, None, False),
    ("a stale phase of a task not heard", STEADY, stale_standby_phase, True),
    ("an active step not running", STEADY, not_running, False),
    ("an active node handing over", STEADY, releasing, False),
    ("nobody heard yet", {}, None, False),
]


@pytest.mark.parametrize(("phases", "change", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_judged_says_what_the_views_say(
    phases: dict[str, str | None], change: Callable[[JobState], None] | None, expected: bool
) -> None:
    job = job_of(phases)
    if change is not None:
        change(job)
    ranks = views(job, 10.5, 1.0)
    assert judged(job) == expected == (bool(ranks) and all(r.phase in JUDGED for r in ranks))
