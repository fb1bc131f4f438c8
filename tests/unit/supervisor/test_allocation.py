"""Shrinking the job runs off the loop's thread: a release that Slurm holds for seconds
(22.05 refused one after 5-10 s) never stalls the loop; its outcome is logged later."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from torchpass_slurm.config import SupervisorConfig
from torchpass_slurm.errors import SlurmError
from torchpass_slurm.rundir import events as ev
from torchpass_slurm.supervisor import allocation as allocation_module
from torchpass_slurm.supervisor.allocation import Allocation
from torchpass_slurm.supervisor.context import JobContext
from torchpass_slurm.supervisor.membership import Membership
from torchpass_slurm.supervisor.state import JobState


class HeldSlurm:
    """Slurm whose shrink waits for :attr:`go`, then does ``outcome`` (None: shrinks)."""

    def __init__(self, outcome: Exception | None = None) -> None:
        self.go = threading.Event()
        self.outcome = outcome
        self.nodes = ["c1", "c2", "c3", "c4"]
        self.shrinks: list[list[str]] = []

    def job(self, job_id: int) -> SimpleNamespace:
        return SimpleNamespace(nodes=list(self.nodes))

    def shrink_job(self, job_id: int, keep: list[str]) -> None:
        assert self.go.wait(10)
        if self.outcome is not None:
            raise self.outcome
        self.shrinks.append(keep)
        self.nodes = keep


def allocation(tmp_path: Path, slurm: HeldSlurm) -> tuple[Allocation, Path]:
    path = tmp_path / ev.EVENTS_FILE
    job = JobState(job_id=9, membership=Membership.initial(["c1", "c2", "c3", "c4"], 3, 1))
    events = ev.EventLog(path, job="9")
    ctx = JobContext(job, slurm=slurm, events=events, config=SupervisorConfig(), clock=time)  # type: ignore[arg-type]
    return Allocation(ctx), path


def released(path: Path) -> list[dict[str, object]]:
    return [e.fields for e in ev.read_events(path) if e.kind == ev.NODE_RELEASED] if path.exists() else []


def settle(alloc: Allocation) -> None:
    """Collect outcomes, as the loop does every pass, until no shrink is in flight (5 s at most)."""
    deadline = time.monotonic() + 5
    while alloc.pending and time.monotonic() < deadline:
        alloc.collect()
        time.sleep(0.01)


def test_a_held_shrink_does_not_hold_the_caller_and_is_logged_once_done(tmp_path: Path) -> None:
    slurm = HeldSlurm()
    alloc, path = allocation(tmp_path, slurm)
    began = time.monotonic()
    alloc.release("c2")
    alloc.collect()
    assert time.monotonic() - began < 0.5 and released(path) == [] and alloc.pending == 1
    assert "c2" in alloc.job.released  # the books change at once; Slurm's answer comes later
    slurm.go.set()
    settle(alloc)
    assert released(path) == [{"node": "c2", "released": True, "reason": "drained"}]
    assert slurm.shrinks == [["c1", "c3", "c4"]]
    alloc.close()


def test_shrinks_run_in_order_and_close_waits_for_them(tmp_path: Path) -> None:
    slurm = HeldSlurm()
    alloc, path = allocation(tmp_path, slurm)
    alloc.shrink_out(["c3"], reason="lost")
    alloc.release("c2")
    slurm.go.set()
    alloc.close()
    assert slurm.shrinks == [["c1", "c2", "c4"], ["c1", "c4"]]
    assert [(f["node"], f["reason"]) for f in released(path)] == [("c3", "lost"), ("c2", "drained")]
    alloc.close()  # idempotent


def test_a_refused_shrink_leaves_the_node_in_the_job_and_says_why(tmp_path: Path) -> None:
    slurm = HeldSlurm(SlurmError("Job update not available right now, the DB index is being set"))
    alloc, path = allocation(tmp_path, slurm)
    alloc.shrink_out(["c3", "c4"], reason="lost")
    slurm.go.set()
    alloc.close()
    assert [(f["node"], f["released"]) for f in released(path)] == [("c3", False), ("c4", False)]
    assert "DB index" in str(released(path)[0]["error"])


def test_a_backend_that_breaks_is_reported_not_fatal(tmp_path: Path) -> None:
    slurm = HeldSlurm(ValueError("unparsable scontrol output"))
    alloc, path = allocation(tmp_path, slurm)
    alloc.release("c2")
    slurm.go.set()
    alloc.close()
    ((fields),) = released(path)
    assert fields["released"] is False and "unparsable" in str(fields["error"])


class RefusedForNow(HeldSlurm):
    """Slurm 22.05 right after a job started: "try again in a bit", ``refusals`` times."""

    def __init__(self, refusals: int) -> None:
        super().__init__()
        self.go.set()
        self.refusals = refusals
        self.tries = 0

    def shrink_job(self, job_id: int, keep: list[str]) -> None:
        self.tries += 1
        if self.tries <= self.refusals:
            raise SlurmError(
                "Job update not available right now, the DB index is being set, try again in a bit"
            )
        super().shrink_job(job_id, keep)


def test_a_shrink_refused_for_now_is_tried_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocation_module, "RETRY_DELAYS_S", (0.05, 0.05, 0.05))
    slurm = RefusedForNow(refusals=2)
    alloc, path = allocation(tmp_path, slurm)
    alloc.release("c2")
    settle(alloc)
    assert slurm.tries == 3 and slurm.shrinks == [["c1", "c3", "c4"]]
    assert released(path) == [{"node": "c2", "released": True, "reason": "drained"}]
    alloc.close()


def test_the_tries_end_with_the_job_or_when_they_run_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(allocation_module, "RETRY_DELAYS_S", (30.0,))
    slurm = RefusedForNow(refusals=5)
    alloc, path = allocation(tmp_path, slurm)
    alloc.release("c2")
    time.sleep(0.2)  # the first try was refused; the thread waits 30 s for the next
    began = time.monotonic()
    alloc.close()  # the job ends: no more tries
    assert time.monotonic() - began < 5 and slurm.tries == 1
    ((fields),) = released(path)
    assert fields["released"] is False and "try again" in str(fields["error"])

    monkeypatch.setattr(allocation_module, "RETRY_DELAYS_S", (0.01, 0.01))
    slurm = RefusedForNow(refusals=5)
    (tmp_path / "again").mkdir()
    alloc, path = allocation(tmp_path / "again", slurm)
    alloc.release("c2")
    settle(alloc)
    assert slurm.tries == 3 and released(path)[0]["released"] is False  # 1 + 2 tries, then given up
    alloc.close()


def test_a_node_asked_out_twice_is_shrunk_once_and_a_shrink_that_changes_nothing_is_never_made(
    tmp_path: Path,
) -> None:
    """A plan made again after a hold names its lost node again; on Slurm 24.11 a shrink to the
    nodes the job already had left a node merged since with no CPU, its steps pending for good."""
    slurm = HeldSlurm()
    alloc, path = allocation(tmp_path, slurm)
    alloc.shrink_out(["c3"], reason="lost")
    alloc.shrink_out(["c3"], reason="lost")  # the same loss, planned again
    slurm.go.set()
    settle(alloc)
    assert slurm.shrinks == [["c1", "c2", "c4"]]
    assert [f["node"] for f in released(path)] == ["c3"]
    alloc.shrink_out(["c5"], reason="lost")  # not the job's (any more): nothing to ask Slurm
    settle(alloc)
    assert slurm.shrinks == [["c1", "c2", "c4"]]
    alloc.close()
