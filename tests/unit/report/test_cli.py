"""`tp report`: the full text (one job, several jobs with totals), the JSON, and the errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.unit.cli.conftest import tp

from .conftest import checkpoint_restart, fatal, two_live_migrations

#: ``tp report --explain``'s legend at 100 columns.
LEGEND = """\
A fault is unplanned (the first detection -- heartbeat_lost, rank_hung, node_down, step_exited with
exit code != 0 -- of an active node; more in one recovery count once), pre-emptive (a drain after
the node's health_warning, or with the reason "torchpass: pre-emptive") or planned (another drain);
a drain counts once migrated (migration_started mode=planned) or deferred (drain_deferred: nothing
lost). Resolution: deferred, else migration_done.resolution, else restarted from a checkpoint ->
checkpoint, else failed -> fatal. Phases (s): detect = last heartbeat -> detected (none for a drain,
detected at drain_seen or health_warning), decide = -> migration_started, rebuild = -> last
group_rebuilt, agree = -> agreement, transfer = -> last transfer_done, first step = -> first_step;
total = detected -> first_step; - = not in the log. Lost = committed steps lost
(migration_done.lost_steps), unknown when the log does not say; lost and recomputed steps are per
recovery, in the class of its first fault. No lost progress = lost == 0, per class and over all.
Spare faults cost no progress. Times are UTC.
"""

HEADER = (
    "#   TIME       CLASS       NODE   DETECTOR         RESOLUTION   LOST   RECOMPUTED   DETECT   DECIDE"
    "   REBUILD   AGREE   TRANSFER   FIRST STEP   TOTAL"
)

#: ``summary.by_class.unplanned`` and ``summary.total`` of :func:`two_live_migrations`.
LIVE_ONLY = {
    "events": 2,
    "no_lost_progress": 2,
    "no_lost_progress_share": 1.0,
    "resolutions": {"live": 2},
    "recoveries": 2,
    "lost_steps": 0,
    "lost_steps_unknown": 0,
    "recomputed_steps": 3,
    "recomputed_steps_unknown": 0,
}


def test_two_live_migrations(job_log: Any) -> None:
    log = two_live_migrations(job_log())
    log.at(62.0, "spare_lost", node="s9", spares_left=0)  # after the end, to show the spare line
    assert tp("report", str(log.run_dir)) == (
        0,
        f"""\
job 4242  {log.run_dir}
{HEADER}
{"─" * len(HEADER)}
1   05:06:17   unplanned   n2     heartbeat_lost   live            0            0     3.00     0.50      0.75    0.25       1.00         0.50    3.00
2   05:06:47   unplanned   n3     node_down        live            0            3     2.00     0.25      0.75    0.25       1.00         0.50    2.75
2 of 2 faults resolved by live migration with 0 committed steps lost (100% with no lost progress)
1 spare lost on standby (no progress lost): s9 (spare_lost)
""",  # noqa: E501 (the report's table, as printed)
        "",
    )
    assert "A fault is unplanned" not in tp("report", str(log.run_dir)).out


def test_explain_prints_the_legend_under_the_report(job_log: Any) -> None:
    log = two_live_migrations(job_log())
    plain = tp("report", str(log.run_dir))
    assert tp("report", "--explain", str(log.run_dir)) == (0, f"{plain.out}\n{LEGEND}", "")


def test_several_jobs_with_totals(job_log: Any) -> None:
    a = two_live_migrations(job_log("a", "4242"))
    b = checkpoint_restart(job_log("b", "4243"))
    c = fatal(job_log("c", "4244"))
    outcome = tp("report", str(a.run_dir), str(b.run_dir), str(c.run_dir))
    assert outcome.code == 0
    assert outcome.err == ""
    assert outcome.out.endswith("progress)\n")  # the last section's last line: no legend under it
    sections = outcome.out[:-1].split("\n\n")
    assert [s.splitlines()[0] for s in sections] == [
        f"job 4242  {a.run_dir}",
        f"job 4243  {b.run_dir}",
        f"job 4244  {c.run_dir}",
        "totals",
    ]
    assert sections[1].splitlines()[3:] == [
        "1   05:06:17   unplanned   n2     heartbeat_lost   checkpoint   unknown      unknown        -"
        "        -"
        "         -       -          -            -       -",
        "1 of 1 fault resolved by checkpoint restart with an unknown number of committed steps lost "
        "(0% with no lost progress)",
    ]
    assert sections[2].splitlines()[3:] == [
        "1   05:06:12   unplanned   n1     node_down   fatal        unknown      unknown        -        -"
        "         -       -          -            -       -",
        "1 of 1 fault was fatal (0% with no lost progress)",
    ]
    class_header = (
        "CLASS       EVENTS   NO LOST PROGRESS   SHARE   LIVE   CHECKPOINT   OTHER            LOST"
        "      RECOMPUTED"
    )
    assert (
        sections[3]
        == f"""\
totals
{class_header}
{"─" * len(class_header)}
unplanned        4                  2     50%      2            1       1   0 + 2 unknown   3 + 2 unknown
{"─" * len(class_header)}
total            4                  2     50%      2            1       1   0 + 2 unknown   3 + 2 unknown
RESOLUTION   FAULTS   RECOVERIES      LOST   RECOMPUTED
───────────────────────────────────────────────────────
live              2            2         0            3
checkpoint        1            1   unknown      unknown
fatal             1            1   unknown      unknown
2 of 4 faults resolved by live migration with 0 committed steps lost; 1 resolved by checkpoint \
restart with an unknown number of committed steps lost; 1 was fatal (50% with no lost progress)"""
    )


def test_a_job_without_faults(job_log: Any) -> None:
    log = job_log()
    log.started(["n1"], [])
    log.at(5.0, "step_exited", node="n1", exit_code=0)
    assert tp("report", str(log.run_dir)) == (
        0,
        f"""\
job 4242  {log.run_dir}
no faults on active nodes
""",
        "",
    )


def test_json_of_one_job(job_log: Any) -> None:
    log = two_live_migrations(job_log())
    code, out, err = tp("report", str(log.run_dir), "--json")
    assert (code, err) == (0, "")
    document = json.loads(out)
    assert document["job"] == "4242"
    assert document["run_dir"] == str(log.run_dir)
    assert document["spare_faults"] == []
    assert document["faults"][1] == {
        "index": 2,
        "class": "unplanned",
        "time": 1741064807.0,
        "node": "n3",
        "kind": "node_down",
        "detector": "node_down",
        "detail": "n3 failed",
        "exit_code": None,
        "recovery": 2,
        "resolution": "live",
        "lost_steps": 0,
        "recomputed_steps": 3,
        "fallback": None,
        "held_s": None,
        "phases": {
            "detection": 2.0,
            "decision": 0.25,
            "rebuild": 0.75,
            "agreement": 0.25,
            "transfer": 1.0,
            "first_step": 0.5,
            "total": 2.75,
        },
    }
    assert document["summary"] == {
        "faults": 2,
        "no_lost_progress": 2,
        "no_lost_progress_share": 1.0,
        "recoveries": 2,
        "lost_steps": 0,
        "lost_steps_unknown": 0,
        "recomputed_steps": 3,
        "recomputed_steps_unknown": 0,
        "spare_faults": 0,
        "by_resolution": {
            "live": {
                "faults": 2,
                "recoveries": 2,
                "lost_steps": 0,
                "lost_steps_unknown": 0,
                "recomputed_steps": 3,
                "recomputed_steps_unknown": 0,
            }
        },
        "by_class": {"unplanned": LIVE_ONLY},
        "total": LIVE_ONLY,
        "text": "2 of 2 faults resolved by live migration with 0 committed steps lost "
        "(100% with no lost progress)",
    }


def test_json_of_several_jobs(job_log: Any) -> None:
    a = two_live_migrations(job_log("a", "4242"))
    c = fatal(job_log("c", "4244"))
    code, out, err = tp("report", str(a.run_dir), str(c.run_dir), "--json")
    assert (code, err) == (0, "")
    document = json.loads(out)
    assert [job["job"] for job in document["jobs"]] == ["4242", "4244"]
    assert document["totals"]["by_resolution"] == {
        "live": {
            "faults": 2,
            "recoveries": 2,
            "lost_steps": 0,
            "lost_steps_unknown": 0,
            "recomputed_steps": 3,
            "recomputed_steps_unknown": 0,
        },
        "fatal": {
            "faults": 1,
            "recoveries": 1,
            "lost_steps": None,
            "lost_steps_unknown": 1,
            "recomputed_steps": None,
            "recomputed_steps_unknown": 1,
        },
    }
    assert (document["totals"]["faults"], document["totals"]["no_lost_progress_share"]) == (3, 0.6667)


def test_a_missing_run_dir(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    assert tp("report", str(missing)) == (
        1,
        "",
        (
            f"error: '{missing}' is neither a folder nor a Slurm job id\n"
            "  hint: pass a job id (e.g. 4242) or the job's run folder\n"
        ),
    )


def test_a_folder_that_holds_no_run_dir(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "events.txt").write_text("")
    assert tp("report", str(tmp_path)) == (
        1,
        "",
        (
            f"error: {tmp_path} is neither a torchpass run folder nor a folder of run folders: "
            "neither it nor any folder in it has status.json or events.jsonl\n"
            "  hint: pass a job id, a run folder, or the folder that holds the run folders "
            "(e.g. /shared/runs)\n"
        ),
    )


def test_a_run_dir_without_an_event_log(tmp_path: Path) -> None:
    (tmp_path / "status.json").write_text("{}")
    assert tp("report", str(tmp_path)) == (
        1,
        "",
        (f"error: cannot read the event log {tmp_path}/events.jsonl: No such file or directory\n"),
    )


def test_one_bad_run_dir_among_several_prints_nothing(job_log: Any, tmp_path: Path) -> None:
    log = two_live_migrations(job_log())
    code, out, _ = tp("report", str(log.run_dir), str(tmp_path / "nowhere"))
    assert (code, out) == (1, "")


def test_a_run_dir_is_required() -> None:
    code, out, err = tp("report")
    assert (code, out) == (2, "")
    assert "Missing argument 'JOB_OR_RUN_DIR...'" in err


def test_listed_in_tp_help() -> None:
    code, out, _ = tp("--help")
    assert code == 0
    assert "report    Show a job's faults, how each was resolved, the recovery times." in out


def test_a_restart_for_want_of_a_replica_says_so_after_its_resolution(job_log: Any) -> None:
    log = job_log()
    log.started(["n1", "n2"], ["s1"])
    log.at(10.0, "heartbeat_lost", node="n2", role="active", detector="heartbeat_lost", detail="n2 silent")
    log.log.epoch = 1
    log.at(
        10.25,
        "migration_started",
        failed=["n2"],
        spares=["s1"],
        last_heartbeat=None,
        committed_step=3,
        mode="restart",
        fallback="no replica",
        detail="no replica: rank(s) 1 lost with every replica",
    )
    log.at(10.5, "restarted", restarts=1, active=["n1", "s1"], spares=[], from_checkpoint=True)
    log.at(30.0, "finished", exit_code=0, message="training done", restarts=1)
    code, out, err = tp("report", str(log.run_dir))
    assert (code, err) == (0, "")
    assert "heartbeat_lost   checkpoint (no replica)   unknown" in out
    (fault,) = json.loads(tp("report", str(log.run_dir), "--json").out)["faults"]
    assert (fault["resolution"], fault["fallback"]) == ("checkpoint", "no replica")
