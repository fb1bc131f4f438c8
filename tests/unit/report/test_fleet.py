"""`tp report` over a fleet: a folder of run folders, the totals per fault class, --totals-only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.unit.cli.conftest import tp

from .conftest import PRE_EMPTIVE, checkpoint_restart, every_class, fatal, two_live_migrations
from .test_cli import LEGEND

CLASS_HEADER = (
    "CLASS         EVENTS   NO LOST PROGRESS   SHARE   LIVE   CHECKPOINT   OTHER            LOST"
    "      RECOMPUTED"
)
#: The totals of :func:`fleet`.
TOTALS = f"""\
totals
{CLASS_HEADER}
{"─" * len(CLASS_HEADER)}
unplanned          5                  3     60%      3            1       1   0 + 2 unknown   4 + 2 unknown
pre-emptive        1                  1    100%      1            0       0               0               0
planned            1                  1    100%      0            0       1               0               0
{"─" * len(CLASS_HEADER)}
total              7                  5     71%      4            1       2   0 + 2 unknown   4 + 2 unknown
RESOLUTION   FAULTS   RECOVERIES      LOST   RECOMPUTED
───────────────────────────────────────────────────────
live              4            4         0            4
checkpoint        1            1   unknown      unknown
deferred          1            1         0            0
fatal             1            1   unknown      unknown
4 of 7 faults resolved by live migration with 0 committed steps lost; 1 resolved by checkpoint restart \
with an unknown number of committed steps lost; 1 deferred to the end of the job with 0 committed steps \
lost; 1 was fatal (71% with no lost progress)"""


@pytest.fixture
def fleet(job_log: Any, tmp_path: Path) -> Path:
    """``runs/``: four jobs' run folders, a job that has not started (no event log), and clutter."""
    runs = tmp_path / "runs"
    runs.mkdir()
    two_live_migrations(job_log("runs/r1", "4301"))
    every_class(job_log("runs/r2", "4302"))
    checkpoint_restart(job_log("runs/r3", "4303"))
    fatal(job_log("runs/r4", "4304"))
    (runs / "pending").mkdir()
    (runs / "pending" / "status.json").write_text("{}")
    (runs / "scratch").mkdir()  # not a run folder: not listed
    (runs / "README").write_text("one folder per job\n")
    return runs


def skipped(run_dir: Path) -> str:
    return f"warning: skipping {run_dir}: it has no events.jsonl\n"


def test_a_folder_of_run_folders_is_every_job_in_it(fleet: Path) -> None:
    code, out, err = tp("report", str(fleet))
    assert (code, err) == (0, skipped(fleet / "pending"))
    assert out.endswith("progress)\n")  # the totals' last line: no legend under it
    sections = out[:-1].split("\n\n")
    assert [s.splitlines()[0] for s in sections[:4]] == [
        f"job 4301  {fleet}/r1",
        f"job 4302  {fleet}/r2",
        f"job 4303  {fleet}/r3",
        f"job 4304  {fleet}/r4",
    ]
    assert sections[1].splitlines()[3:] == [
        "1   05:06:17   unplanned     n2     heartbeat_lost   live            0            1     3.00"
        "     0.50      0.75    0.25       1.00         0.50    3.00",
        "2   05:06:37   pre-emptive   n3     health           live            0            0        -"
        "     3.50      0.75    0.25       1.00         0.50    6.00",
        "3   05:06:57   planned       n1     drain            deferred        0            0        -"
        "        -         -       -          -            -       -",
        "2 of 3 faults resolved by live migration with 0 committed steps lost; 1 deferred to the end of the "
        "job with 0 committed steps lost (100% with no lost progress)",
    ]
    assert sections[4] == TOTALS
    assert len(sections) == 5


def test_totals_only(fleet: Path) -> None:
    assert tp("report", "--totals-only", str(fleet)) == (0, f"{TOTALS}\n", skipped(fleet / "pending"))
    explained = (0, f"{TOTALS}\n\n{LEGEND}", skipped(fleet / "pending"))
    assert tp("report", "--totals-only", "--explain", str(fleet)) == explained


def test_totals_only_as_json(fleet: Path) -> None:
    code, out, _ = tp("report", "--totals-only", "--json", str(fleet))
    assert code == 0
    document = json.loads(out)
    assert list(document) == ["totals"]
    totals = document["totals"]
    assert totals["by_class"] == {
        "unplanned": {
            "events": 5,
            "no_lost_progress": 3,
            "no_lost_progress_share": 0.6,
            "resolutions": {"live": 3, "checkpoint": 1, "fatal": 1},
            "recoveries": 5,
            "lost_steps": 0,
            "lost_steps_unknown": 2,
            "recomputed_steps": 4,
            "recomputed_steps_unknown": 2,
        },
        "pre-emptive": {
            "events": 1,
            "no_lost_progress": 1,
            "no_lost_progress_share": 1.0,
            "resolutions": {"live": 1},
            "recoveries": 1,
            "lost_steps": 0,
            "lost_steps_unknown": 0,
            "recomputed_steps": 0,
            "recomputed_steps_unknown": 0,
        },
        "planned": {
            "events": 1,
            "no_lost_progress": 1,
            "no_lost_progress_share": 1.0,
            "resolutions": {"deferred": 1},
            "recoveries": 1,
            "lost_steps": 0,
            "lost_steps_unknown": 0,
            "recomputed_steps": 0,
            "recomputed_steps_unknown": 0,
        },
    }
    assert totals["total"] == {
        "events": 7,
        "no_lost_progress": 5,
        "no_lost_progress_share": 0.7143,
        "resolutions": {"live": 4, "checkpoint": 1, "deferred": 1, "fatal": 1},
        "recoveries": 7,
        "lost_steps": 0,
        "lost_steps_unknown": 2,
        "recomputed_steps": 4,
        "recomputed_steps_unknown": 2,
    }
    assert (totals["faults"], totals["no_lost_progress"], totals["no_lost_progress_share"]) == (7, 5, 0.7143)
    assert {k: v["faults"] for k, v in totals["by_resolution"].items()} == {
        "live": 4,
        "checkpoint": 1,
        "deferred": 1,
        "fatal": 1,
    }


def test_the_json_of_each_job_has_the_class_of_each_fault(fleet: Path) -> None:
    code, out, _ = tp("report", "--json", str(fleet))
    assert code == 0
    document = json.loads(out)
    assert [job["run_dir"] for job in document["jobs"]] == [str(fleet / r) for r in ("r1", "r2", "r3", "r4")]
    faults = document["jobs"][1]["faults"]
    assert [
        (f["class"], f["kind"], f["detector"], f["resolution"], f["lost_steps"], f["recomputed_steps"])
        for f in faults
    ] == [
        ("unplanned", "heartbeat_lost", "heartbeat_lost", "live", 0, 1),
        ("pre-emptive", "health_warning", "health", "live", 0, 0),
        ("planned", "drain_seen", "drain", "deferred", 0, 0),
    ]
    assert faults[1]["detail"] == PRE_EMPTIVE
    assert [f["phases"] for f in faults] == [
        {
            "detection": 3.0,
            "decision": 0.5,
            "rebuild": 0.75,
            "agreement": 0.25,
            "transfer": 1.0,
            "first_step": 0.5,
            "total": 3.0,
        },
        {
            "detection": None,
            "decision": 3.5,
            "rebuild": 0.75,
            "agreement": 0.25,
            "transfer": 1.0,
            "first_step": 0.5,
            "total": 6.0,
        },
        {
            "detection": None,
            "decision": None,
            "rebuild": None,
            "agreement": None,
            "transfer": None,
            "first_step": None,
            "total": None,
        },
    ]
    assert {k: c["events"] for k, c in document["jobs"][1]["summary"]["by_class"].items()} == {
        "unplanned": 1,
        "pre-emptive": 1,
        "planned": 1,
    }
    assert document["totals"]["total"]["events"] == 7


def test_a_job_named_again_inside_its_fleet_counts_once(fleet: Path) -> None:
    code, out, _ = tp("report", "--json", str(fleet / "r2"), str(fleet))
    assert code == 0
    assert [job["job"] for job in json.loads(out)["jobs"]] == ["4302", "4301", "4303", "4304"]


def test_an_unreadable_event_log_in_a_fleet_is_skipped(job_log: Any, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    two_live_migrations(job_log("runs/a", "4301"))
    torn = fatal(job_log("runs/b", "4302"))
    with open(torn.run_dir / "events.jsonl", "a") as f:
        f.write('{"kind": "fail')  # a crash mid-write: the reader skips the torn last line
    broken = job_log("runs/c", "4303").started(["n1"], [])
    with open(broken.run_dir / "events.jsonl", "a") as f:
        f.write("edited by hand\n")
    broken.at(5.0, "finished", exit_code=0, message="training done", restarts=0)
    code, out, err = tp("report", "--totals-only", str(runs))
    assert code == 0
    assert err == (
        f"warning: skipping {runs}/c: {runs}/c/events.jsonl:2 is not a valid event: b'edited by hand'\n"
    )
    assert "total            3                  2     67%" in out.splitlines()[5]


def test_a_fleet_without_an_event_log(tmp_path: Path) -> None:
    (tmp_path / "pending").mkdir()
    (tmp_path / "pending" / "status.json").write_text("{}")
    assert tp("report", str(tmp_path)) == (
        1,
        "",
        (
            f"{skipped(tmp_path / 'pending')}"
            "error: none of the run folders found has a readable event log (1 skipped)\n"
            "  hint: a job that has not started has no events.jsonl yet; see the warnings above\n"
        ),
    )
