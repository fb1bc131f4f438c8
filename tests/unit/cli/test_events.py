"""`tp events`: text lines, JSON lines as stored, kind filters, --follow."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchpass_slurm.cli.events import format_value, parse_kinds
from torchpass_slurm.rundir.events import EventLog

from .conftest import NOW, scontrol_job, tp

LINES = """\
05:05:07.000  e1   started          nodes=["n1","n2","s1","s2"]
05:05:36.500  e1   heartbeat_lost   node=n2 silent_s=20.5
05:05:36.750  e2   spare_promoted   node=s1 reason="heartbeat lost" replaces=n2
05:05:37.000  e2   step_exited      exit_code=137 node=n2
"""


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ("n2", "n2"),
        ("a b", '"a b"'),
        ("", '""'),
        ("k=v", '"k=v"'),
        (None, "null"),
        (True, "true"),
        (1.5, "1.5"),
        ({"b": 1, "a": [2]}, '{"a":[2],"b":1}'),
    ],
)
def test_format_value(value: object, text: str) -> None:
    assert format_value(value) == text


def test_parse_kinds() -> None:
    assert parse_kinds(["a", "b,c", " ,d "]) == {"a", "b", "c", "d"}
    assert parse_kinds([]) == frozenset()


def test_text(run_dir: Path) -> None:
    assert tp("events", str(run_dir)) == (0, LINES, "")


def test_json_lines_are_the_stored_lines(run_dir: Path) -> None:
    assert tp("events", str(run_dir), "--json") == (0, (run_dir / "events.jsonl").read_text(), "")


def test_kind_filter(run_dir: Path) -> None:
    lines = LINES.splitlines(keepends=True)
    assert tp("events", str(run_dir), "--kind", "step_exited", "-k", "started") == (
        0,
        lines[0] + lines[3],
        "",
    )
    assert tp("events", str(run_dir), "--kind", "heartbeat_lost,spare_promoted") == (
        0,
        "".join(lines[1:3]),
        "",
    )
    assert tp("events", str(run_dir), "--kind", "restarted") == (0, "", "")


def test_follow_stops_at_the_end_of_the_job(run_dir: Path) -> None:
    with EventLog(run_dir / "events.jsonl", job="4242", epoch=2, clock=lambda: NOW) as log:
        log.append("finished", exit_code=0)
    result = tp("events", str(run_dir), "--follow", "--kind", "step_exited,finished")
    assert result == (
        0,
        LINES.splitlines(keepends=True)[3] + "05:06:07.000  e2   finished         exit_code=0\n",
        "",
    )


def test_by_job_id(run_dir: Path, slurm_job) -> None:  # type: ignore[no-untyped-def]
    slurm_job(scontrol_job(comment=f"torchpass:run_dir={run_dir}"))
    assert tp("events", "1") == (0, LINES, "")


def test_run_folder_without_an_event_log(run_dir: Path) -> None:
    (run_dir / "events.jsonl").unlink()
    assert tp("events", str(run_dir)) == (
        1,
        "",
        (f"error: cannot read the event log {run_dir}/events.jsonl: No such file or directory\n"),
    )


def test_a_corrupt_line_is_skipped_and_said(run_dir: Path) -> None:
    """A bad line (an edit, another writer) no longer hides the rest of the job's events."""
    with open(run_dir / "events.jsonl", "a") as f:
        f.write("not json\n")
    assert tp("events", str(run_dir)) == (
        0,
        LINES,
        (f"tp events: skipped 1 line(s) of {run_dir}/events.jsonl that are not events (line 5)\n"),
    )
