"""A recovery that ends with the training: :meth:`Completion.training_ended` closes it."""

from __future__ import annotations

import json
from pathlib import Path

from torchpass_slurm.config import SupervisorConfig
from torchpass_slurm.faults import Resolution
from torchpass_slurm.rundir import events as ev
from torchpass_slurm.supervisor.completion import Completion
from torchpass_slurm.supervisor.context import JobContext
from torchpass_slurm.supervisor.membership import Membership
from torchpass_slurm.supervisor.state import JobState, Migration


class Clock:
    def time(self) -> float:
        return 1_700_000_100.0

    def monotonic(self) -> float:
        return 100.0


def completion(tmp_path: Path, migration: Migration | None) -> tuple[Completion, Path]:
    path = tmp_path / ev.EVENTS_FILE
    job = JobState(job_id=7, membership=Membership.initial(["c1", "c2", "c3"], 2, 1), migration=migration)
    events = ev.EventLog(path, job="7", clock=Clock().time)
    ctx = JobContext(job, slurm=None, events=events, config=SupervisorConfig(), clock=Clock())  # type: ignore[arg-type]
    return Completion(ctx), path


def done_events(path: Path) -> list[dict[str, object]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [line for line in lines if line["kind"] == ev.MIGRATION_DONE]


def planned(**fields: object) -> Migration:
    return Migration(
        epoch=1,
        started=1_700_000_090.0,
        committed=23,
        failed=("c2",),
        planned=True,
        promoted=("c3",),
        **fields,
    )  # type: ignore[arg-type]


def test_a_switch_after_the_last_step_is_closed_live_at_the_end(tmp_path: Path) -> None:
    c, path = completion(tmp_path, planned())
    c.released()
    c.agreed(1, 24)  # the ranks switched after step 24, the last: no first step follows
    assert c.unswitched() == ()
    c.training_ended()
    (done,) = done_events(path)
    assert {
        k: done[k] for k in ("resolution", "lost_steps", "recomputed_steps", "planned", "at_end", "seconds")
    } == {
        "resolution": "live",
        "lost_steps": 0,
        "recomputed_steps": 0,
        "planned": True,
        "at_end": True,
        "seconds": 10.0,
    }
    assert c.job.migration is None


def test_a_move_nobody_switched_to_is_closed_deferred(tmp_path: Path) -> None:
    c, path = completion(tmp_path, planned())
    assert c.unswitched() == ("c3",)
    c.training_ended()
    (done,) = done_events(path)
    assert (done["resolution"], done["lost_steps"], done["detail"]) == (
        "deferred",
        0,
        "the training ended before the switch step",
    )


def test_a_leaving_rank_that_released_means_the_switch_came(tmp_path: Path) -> None:
    c, _ = completion(tmp_path, planned())
    c.released()  # the spare's agreement may still be on its way: it is waited for
    assert c.unswitched() == ()


def test_an_unplanned_live_recovery_with_no_step_left_is_closed_with_its_losses(tmp_path: Path) -> None:
    mig = Migration(epoch=1, started=1_700_000_095.0, committed=24, failed=("c2",))
    c, path = completion(tmp_path, mig)
    assert c.unswitched() == ()
    c.agreed(1, 23)
    c.training_ended()
    (done,) = done_events(path)
    assert (done["resolution"], done["lost_steps"], done["at_end"]) == ("live", 1, True)


def test_a_checkpoint_restart_is_left_to_its_resume(tmp_path: Path) -> None:
    c, path = completion(
        tmp_path,
        Migration(epoch=1, started=0.0, committed=5, failed=("c2",), resolution=Resolution.CHECKPOINT),
    )
    c.training_ended()
    assert done_events(path) == [] and c.job.migration is not None


def test_no_recovery_in_flight_writes_nothing(tmp_path: Path) -> None:
    c, path = completion(tmp_path, None)
    c.training_ended()
    assert done_events(path) == []
