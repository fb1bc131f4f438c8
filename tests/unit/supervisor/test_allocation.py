"""Shrinking the job runs off the loop's thread: a release that Slurm holds for seconds
(22.05 refused one after 5-10 s) never stalls the loop; its outcome is logged later."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

from torchpass_slurm import events as ev
from torchpass_slurm.errors import SlurmError
from torchpass_slurm.supervisor.allocation import Allocation
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
    return Allocation(job, slurm=slurm, events=ev.EventLog(path, job="9")), path  # type: ignore[arg-type]


def released(path: Path) -> list[dict[str, object]]:
    return [e.fields for e in ev.read_events(path) if e.kind == ev.NODE_RELEASED] if path.exists() else []


def test_a_held_shrink_does_not_hold_the_caller_and_is_logged_once_done(tmp_path: Path) -> None:
    slurm = HeldSlurm()
    alloc, path = allocation(tmp_path, slurm)
    began = time.monotonic()
    alloc.release("c2")
    alloc.collect()
    assert time.monotonic() - began < 0.5 and released(path) == [] and alloc.pending == 1
    assert "c2" in alloc.job.released  # the books change at once; Slurm's answer comes later
    slurm.go.set()
    deadline = time.monotonic() + 5
    while alloc.pending and time.monotonic() < deadline:
        alloc.collect()
        time.sleep(0.01)
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
