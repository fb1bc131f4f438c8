"""`tp status`: the table, --json, --watch and every way the run folder can be wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchpass_slurm.cli.status import compact_ranks, format_age, heartbeat_style, is_stale
from torchpass_slurm.rundir.status import JobStatus, NodeStatus, read_status, write_status

from .conftest import NOW, job_status, scontrol_job, tp

TABLE = """\
 NODE   ROLE     RANKS   STATE     STEP   HEARTBEAT   EXIT 
───────────────────────────────────────────────────────────
 n1     active   0-3     running   120    0.4s        -    
 s1     active   4-7     running   119    6.0s        -    
 n2     failed   -       lost      97     1m15s       137  
 s2     spare    -       standby   -      25s         -    
"""  # noqa: W291 (rich pads every cell: the table as printed)

HEADER = "job 4242  running  epoch 2  world size 8  restarts 0  status 1.0s old\nspare s1 replaced n2\n"


@pytest.mark.parametrize(
    ("ranks", "text"),
    [
        ((), "-"),
        ((3,), "3"),
        ((0, 1, 2, 3), "0-3"),
        ((11, 0, 1, 2, 3, 8, 10), "0-3,8,10-11"),
        ((1, 1, 2), "1-2"),
    ],
)
def test_compact_ranks(ranks: tuple[int, ...], text: str) -> None:
    assert compact_ranks(ranks) == text


@pytest.mark.parametrize(
    ("age", "text"),
    [
        (None, "-"),
        (-0.3, "0.0s"),
        (1.25, "1.2s"),
        (9.96, "10.0s"),
        (42.9, "42s"),
        (185, "3m05s"),
        (7620, "2h07m"),
    ],
)
def test_format_age(age: float | None, text: str) -> None:
    assert format_age(age) == text


def test_heartbeat_colours_only_nodes_that_should_beat() -> None:
    active, released = NodeStatus("n1", "active"), NodeStatus("n2", "released")
    assert [heartbeat_style(active, age) for age in (None, 1.0, 4.0, 20.0)] == ["", "", "yellow", "red"]
    assert heartbeat_style(released, 600.0) == ""


def test_stale_only_while_the_job_is_not_final(tmp_path: Path) -> None:
    assert not is_stale(job_status(tmp_path, updated=NOW - 30), NOW)
    assert is_stale(job_status(tmp_path, updated=NOW - 31), NOW)
    assert not is_stale(job_status(tmp_path, updated=NOW - 3600, state="failed"), NOW)


def test_table(run_dir: Path) -> None:
    assert tp("status", str(run_dir)) == (0, HEADER + TABLE, "")


def test_table_warns_when_the_supervisor_stopped_writing(run_dir: Path) -> None:
    write_status(run_dir, job_status(run_dir, updated=NOW - 95, message=""))
    result = tp("status", str(run_dir))
    assert result == (
        0,
        (
            "job 4242  running  epoch 2  world size 8  restarts 0  status 1m35s old\n"
            "warning: no update for 1m35s: the supervisor is gone or hung (see `squeue`, the job's output)\n"
            + TABLE
        ),
        "",
    )


def test_json_adds_ages(run_dir: Path) -> None:
    result = tp("status", str(run_dir), "--json")
    assert (result.code, result.err) == (0, "")
    doc = json.loads(result.out)
    assert doc["status_age"] == 1.0
    assert [(n["node"], n["heartbeat_age"]) for n in doc["nodes"]] == [
        ("n1", 0.4),
        ("s1", 6.0),
        ("n2", 75.0),
        ("s2", 25.0),
    ]
    assert doc["nodes"][0] == {
        "node": "n1",
        "role": "active",
        "ranks": [0, 1, 2, 3],
        "state": "running",
        "last_step": 120,
        "last_heartbeat": NOW - 0.4,
        "exit_code": None,
        "heartbeat_age": 0.4,
    }
    assert {k: doc[k] for k in ("job_id", "state", "epoch", "world_size", "restarts", "format")} == {
        "job_id": "4242",
        "state": "running",
        "epoch": 2,
        "world_size": 8,
        "restarts": 0,
        "format": 1,
    }


def test_watch_stops_when_the_job_is_final(run_dir: Path) -> None:
    write_status(run_dir, job_status(run_dir, state="succeeded", message="done"))
    assert tp("status", str(run_dir), "--watch", "--interval", "0.1") == (
        0,
        ("job 4242  succeeded  epoch 2  world size 8  restarts 0  status 1.0s old\ndone\n" + TABLE),
        "",
    )


def test_watch_and_json_do_not_mix(run_dir: Path) -> None:
    result = tp("status", str(run_dir), "--watch", "--json")
    assert (result.code, result.out) == (2, "")
    assert result.err.endswith("Error: --json and --watch cannot be combined\n")


def test_by_job_id(run_dir: Path, slurm_job) -> None:  # type: ignore[no-untyped-def]
    slurm_job(scontrol_job(comment=f"torchpass:run_dir={run_dir}"))
    assert tp("status", "1") == (0, HEADER + TABLE, "")


def test_job_without_comment(slurm_job) -> None:  # type: ignore[no-untyped-def]
    slurm_job(scontrol_job())
    assert tp("status", "1") == (
        1,
        "",
        (
            "error: job 1 was not submitted with tp-submit (no torchpass run dir in its comment); "
            "pass the run folder instead\n"
            "  hint: the run folder holds status.json and events.jsonl; "
            "tp-submit printed it when it submitted\n"
        ),
    )


def test_missing_run_dir(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    assert tp("status", str(missing)) == (
        1,
        "",
        (
            f"error: {str(missing)!r} is neither a folder nor a Slurm job id\n"
            "  hint: pass a job id (e.g. 4242) or the job's run folder\n"
        ),
    )


def test_run_dir_without_status_yet(run_dir: Path) -> None:
    (run_dir / "status.json").unlink()
    assert tp("status", str(run_dir)) == (
        1,
        "",
        (
            f"error: no status file at {run_dir}/status.json\n"
            "  hint: the job may not have started yet, or this is not a tp run folder\n"
        ),
    )


def test_malformed_status_file(run_dir: Path) -> None:
    (run_dir / "status.json").write_text('{"job_id": "4242", ')
    assert tp("status", str(run_dir)) == (
        1,
        "",
        (
            "error: malformed status file: Expecting property name enclosed in double quotes: "
            "line 1 column 20 (char 19)\n"
        ),
    )


def test_the_status_file_is_synced_before_it_replaces_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash between the rename and the write-back must not leave an empty status.json."""
    import os

    from torchpass_slurm.rundir import status as status_mod

    calls: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(status_mod.os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(
        status_mod.os, "replace", lambda a, b: (calls.append("replace"), real_replace(a, b))[1]
    )
    status = JobStatus(
        job_id="1",
        run_dir=str(tmp_path),
        state="running",
        epoch=0,
        world_size=1,
        updated=0.0,
        nodes=(),
        restarts=0,
        message="",
    )

    write_status(tmp_path, status)

    assert calls == ["fsync", "replace"]
    assert read_status(tmp_path) == status


def test_a_job_holding_for_a_spare_says_for_which_node_and_how_long_more(run_dir: Path) -> None:
    write_status(
        run_dir, job_status(run_dir, state="recovering", message="", holding=("n2",), holding_until=NOW + 150)
    )
    result = tp("status", str(run_dir))
    assert result.code == 0
    assert (
        result.out.splitlines()[1]
        == "holding the committed step for a spare to replace n2 (up to 2m30s more)"
    )
    doc = json.loads(tp("status", str(run_dir), "--json").out)
    assert (doc["holding"], doc["holding_until"]) == (["n2"], NOW + 150)
    assert read_status(run_dir).holding == ("n2",)
