"""The pure report: faults, resolutions, phases, steps and totals from event logs."""

from __future__ import annotations

from typing import Any

import pytest

from torchpass_slurm.analysis.report import JobReport, Phases, analyse
from torchpass_slurm.analysis.report_totals import summarise, summary_line
from torchpass_slurm.cli.report import format_seconds, format_steps, format_time
from torchpass_slurm.rundir.events import read_events

from .conftest import T0, JobLog, checkpoint_restart, fatal, two_live_migrations


def report_of(log: JobLog) -> JobReport:
    return analyse(read_events(log.run_dir / "events.jsonl"), source=str(log.run_dir))


def test_two_live_migrations(job_log: Any) -> None:
    report = report_of(two_live_migrations(job_log()))
    assert report.job == "4242"
    assert [
        (f.node, f.detector, f.resolution, f.lost_steps, f.recomputed_steps, f.recovery)
        for f in report.faults
    ] == [("n2", "heartbeat_lost", "live", 0, 0, 1), ("n3", "node_down", "live", 0, 3, 2)]
    assert report.faults[0].ts == T0 + 10.0
    assert report.faults[0].phases == Phases(
        detection=3.0, decision=0.5, rebuild=0.75, agreement=0.25, transfer=1.0, first_step=0.5, total=3.0
    )
    assert report.faults[1].phases == Phases(
        detection=2.0, decision=0.25, rebuild=0.75, agreement=0.25, transfer=1.0, first_step=0.5, total=2.75
    )
    assert report.spare_faults == ()
    assert summary_line(summarise([report])) == (
        "2 of 2 faults resolved by live migration with 0 committed steps lost (100% with no lost progress)"
    )


def test_a_step_that_ends_with_exit_code_0_is_no_fault(job_log: Any) -> None:
    log = job_log()
    log.started(["n1"], [])
    log.at(5.0, "step_exited", node="n1", exit_code=0)
    log.at(6.0, "finished", exit_code=0, message="done", restarts=0)
    report = report_of(log)
    assert report.faults == ()
    assert summary_line(summarise([report])) == "no faults on active nodes"


def test_checkpoint_restart(job_log: Any) -> None:
    report = report_of(checkpoint_restart(job_log()))
    (fault,) = report.faults  # the late step_exited of n2 is the same fault
    assert (fault.node, fault.detector, fault.resolution) == ("n2", "heartbeat_lost", "checkpoint")
    assert (fault.lost_steps, fault.recomputed_steps) == (None, None)
    assert fault.phases == Phases()  # no migration events: no phase is known
    assert summary_line(summarise([report])) == (
        "1 of 1 fault resolved by checkpoint restart with an unknown number of committed steps lost "
        "(0% with no lost progress)"
    )


def test_fatal(job_log: Any) -> None:
    report = report_of(fatal(job_log()))
    (fault,) = report.faults
    assert (fault.node, fault.detector, fault.resolution, fault.lost_steps) == (
        "n1",
        "node_down",
        "fatal",
        None,
    )
    assert summary_line(summarise([report])) == "1 of 1 fault was fatal (0% with no lost progress)"


def test_spare_faults_are_apart_and_counted_once(job_log: Any) -> None:
    log = job_log()
    log.started(["n1"], ["s1", "s2"])
    log.detected(3.0, "heartbeat_lost", "s1", role="spare")
    log.at(3.25, "spare_lost", epoch=2, node="s1", spares_left=1)
    log.at(4.0, "spare_lost", epoch=3, node="s2", spares_left=0)
    log.at(5.0, "step_exited", node="s2", exit_code=137)  # no role: s2 was a spare
    report = report_of(log)
    assert report.faults == ()
    assert [(s.node, s.detector) for s in report.spare_faults] == [
        ("s1", "heartbeat_lost"),
        ("s2", "spare_lost"),
    ]
    assert summarise([report]).spare_faults == 2


def test_missing_phase_events_give_null_phases(job_log: Any) -> None:
    log = job_log()
    log.started(["n1", "n2"], ["s1"])
    log.detected(10.0, "heartbeat_lost", "n2")
    log.migration(10.5, 2, ["n2"], ["s1"], last_heartbeat=None, skip=("agreement",))
    (fault,) = report_of(log).faults
    assert fault.phases == Phases(
        detection=None, decision=0.5, rebuild=0.75, agreement=None, transfer=None, first_step=0.5, total=3.0
    )


def test_a_migration_without_its_end_is_unresolved(job_log: Any) -> None:
    log = job_log()
    log.started(["n1", "n2"], ["s1"])
    log.detected(10.0, "heartbeat_lost", "n2")
    log.migration(10.5, 2, ["n2"], ["s1"], last_heartbeat=7.0, skip=("first_step", "migration_done"))
    (fault,) = report_of(log).faults
    assert (fault.resolution, fault.lost_steps) == (None, None)
    assert (fault.phases.first_step, fault.phases.total) == (None, None)
    assert fault.phases.transfer == 1.0
    assert summary_line(summarise([report_of(log)])) == (
        "1 of 1 fault is unresolved in the log (0% with no lost progress)"
    )


def test_migration_done_decides_over_a_restart(job_log: Any) -> None:
    """A migration that fell back: restarted first, then migration_done(resolution=checkpoint)."""
    log = job_log()
    log.started(["n1", "n2"], ["s1"])
    log.detected(10.0, "heartbeat_lost", "n2")
    log.at(10.5, "migration_started", epoch=2, failed=["n2"], spares=["s1"], last_heartbeat=None)
    log.at(11.0, "restarted", epoch=2, restarts=1, active=["n1", "s1"], spares=[], from_checkpoint=True)
    log.at(12.0, "migration_done", epoch=2, resolution="checkpoint", lost_steps=7, recomputed_steps=7)
    (fault,) = report_of(log).faults
    assert (fault.resolution, fault.lost_steps, fault.recomputed_steps) == ("checkpoint", 7, 7)
    assert fault.phases.decision == 0.5


def test_two_nodes_in_one_recovery_count_their_lost_steps_once(job_log: Any) -> None:
    log = job_log()
    log.started(["n1", "n2", "n3"], ["s1", "s2"])
    log.detected(10.0, "heartbeat_lost", "n1")
    log.detected(10.25, "heartbeat_lost", "n2")
    log.at(
        10.5,
        "migration_started",
        epoch=2,
        failed=["n1", "n2"],
        spares=["s1", "s2"],
        last_heartbeat={"n1": T0 + 7.0, "n2": T0 + 8.0},
    )
    log.at(13.0, "first_step", epoch=2, step=96)
    log.at(13.5, "migration_done", epoch=2, resolution="live", lost_steps=5, recomputed_steps=5)
    report = report_of(log)
    assert [(f.node, f.recovery, f.phases.detection, f.phases.total) for f in report.faults] == [
        ("n1", 1, 3.0, 3.0),
        ("n2", 1, 2.25, 2.75),
    ]
    summary = summarise([report])
    totals = summary.by_resolution["live"]
    assert (totals.faults, totals.recoveries, totals.lost_steps, totals.recomputed_steps) == (2, 1, 5, 5)
    assert summary_line(summary) == (
        "2 of 2 faults resolved by live migration with 5 committed steps lost (0% with no lost progress)"
    )


def test_totals_over_several_jobs(job_log: Any) -> None:
    reports = [
        report_of(two_live_migrations(job_log("a", "4242"))),
        report_of(checkpoint_restart(job_log("b", "4243"))),
        report_of(fatal(job_log("c", "4244"))),
    ]
    summary = summarise(reports)
    assert (summary.faults, summary.no_lost_progress) == (4, 2)
    assert list(summary.by_resolution) == ["live", "checkpoint", "fatal"]
    assert summary_line(summary) == (
        "2 of 4 faults resolved by live migration with 0 committed steps lost; "
        "1 resolved by checkpoint restart with an unknown number of committed steps lost; "
        "1 was fatal (50% with no lost progress)"
    )


def test_the_verb_agrees_with_the_number_of_faults(job_log: Any) -> None:
    reports = [report_of(fatal(job_log("a", "4244"))), report_of(fatal(job_log("b", "4245")))]
    assert summary_line(summarise(reports)) == "2 of 2 faults were fatal (0% with no lost progress)"


@pytest.mark.parametrize(("value", "text"), [(None, "-"), (0.0, "0.00"), (1.255, "1.25"), (12.5, "12.50")])
def test_format_seconds(value: float | None, text: str) -> None:
    assert format_seconds(value) == text


def test_format_steps_and_time() -> None:
    assert (format_steps(None), format_steps(0), format_steps(12)) == ("unknown", "0", "12")
    assert format_time(T0 + 10.0) == "05:06:17"


def test_lost_steps_some_known_some_not(job_log: Any) -> None:
    log = job_log()
    log.started(["n1", "n2", "n3"], ["s1", "s2"])
    log.detected(10.0, "heartbeat_lost", "n2")
    log.migration(10.5, 2, ["n2"], ["s1"], last_heartbeat=7.0, lost=2)
    log.detected(20.0, "heartbeat_lost", "n3")
    log.migration(20.5, 3, ["n3"], ["s2"], last_heartbeat=17.0, skip=("migration_done",))
    log.at(23.5, "migration_done", epoch=3, resolution="live")  # no lost_steps: unknown, not 0
    report = report_of(log)
    assert [f.lost_steps for f in report.faults] == [2, None]
    assert summary_line(summarise([report])) == (
        "2 of 2 faults resolved by live migration with 2 committed steps lost "
        "(unknown for 1 of 2 recoveries) "
        "(0% with no lost progress)"
    )


def test_a_rebuild_report_that_arrives_after_the_agreement_ends_the_rebuild_there(job_log: Any) -> None:
    """The ranks' reports arrive in any order; the agreement needs every rank's group."""
    log = job_log()
    log.started(["n1", "n2", "n3"], ["s1"])
    log.detected(10.0, "heartbeat_lost", "n2")
    log.at(10.5, "migration_started", failed=["n2"], spares=["s1"], last_heartbeat=T0 + 7.0)
    log.at(11.0, "group_rebuilt", seconds=0.5)
    log.at(12.0, "agreement", committed_step=100)
    log.at(12.01, "group_rebuilt", seconds=1.5)  # rank 2's report, logged after the agreement
    log.at(12.5, "transfer_done", donor=0, receiver=1, bytes=1024, seconds=0.5, retries=0)
    log.at(13.0, "first_step", step=101)
    log.at(13.1, "migration_done", resolution="live", lost_steps=0, recomputed_steps=1)
    (fault,) = report_of(log).faults
    assert fault.phases == Phases(
        detection=3.0, decision=0.5, rebuild=1.5, agreement=0.0, transfer=0.5, first_step=0.5, total=3.0
    )


def test_a_move_held_for_a_spare_says_how_long_it_waited(job_log: Any) -> None:
    """Issue 24, item 3: no spare at the loss; the job held its step 31.5 s until one joined."""
    log = job_log()
    log.started(["n1", "n2", "n3"], [])
    log.detected(10.0, "heartbeat_lost", "n2")
    log.at(10.25, "holding", failed=["n2"], wait_s=300.0, detail="n2 silent; no hot spare left: holding")
    log.migration(41.75, 1, ["n2"], ["s9"], last_heartbeat=9.0, held_s=31.5)
    log.at(60.0, "finished", exit_code=0, message="training done", restarts=0)

    (fault,) = report_of(log).faults

    assert (fault.resolution, fault.lost_steps, fault.held_s) == ("live", 0, 31.5)
    assert fault.phases.decision == 31.75  # the hold is part of the decision
    assert fault.as_dict()["held_s"] == 31.5
    from rich.console import Console

    from torchpass_slurm.cli.report import print_report

    console = Console(width=300, record=True)
    print_report(console, [report_of(log)])
    assert "live (held 32 s for a spare)" in console.export_text()


def test_a_chain_of_recoveries_is_one_recovery_with_the_chains_steps(job_log: Any) -> None:
    """Issue 24, item 6: a survivor dies during the live move (it falls back to a restart in
    place), and a rank crashes again before the restarted ranks resumed. Each restart continues
    the recovery in flight (``chained_from``): the three faults share one recovery, whose one
    ``migration_done`` says the chain's steps; nothing is unknown, nothing counted twice."""
    log = job_log()
    log.started(["n1", "n2", "n3"], ["s1"])
    log.detected(10.0, "heartbeat_lost", "n2", epoch=1)
    log.migration(10.5, 2, ["n2"], ["s1"], last_heartbeat=9.0, skip=("first_step", "migration_done"))
    log.detected(14.0, "step_exited", "n3", epoch=2)
    log.at(
        14.5,
        "migration_started",
        epoch=3,
        failed=["n3"],
        spares=[],
        last_heartbeat=None,
        mode="restart-in-place",
        chained_from=2,
    )
    log.at(14.6, "restarted", epoch=3, restarts=1, active=["n1", "s1", "n3"], spares=[], from_checkpoint=True)
    log.detected(18.0, "step_exited", "n1", epoch=3)
    log.at(
        18.5,
        "migration_started",
        epoch=4,
        failed=["n1"],
        spares=[],
        last_heartbeat=None,
        mode="restart-in-place",
        chained_from=3,
    )
    log.at(18.6, "restarted", epoch=4, restarts=2, active=["n1", "s1", "n3"], spares=[], from_checkpoint=True)
    log.at(25.0, "migration_done", epoch=4, resolution="checkpoint", lost_steps=4, recomputed_steps=4)
    log.at(60.0, "finished", exit_code=0, message="training done", restarts=2)

    report = report_of(log)
    assert [(f.node, f.recovery, f.resolution, f.lost_steps, f.recomputed_steps) for f in report.faults] == [
        ("n2", 1, "checkpoint", 4, 4),
        ("n3", 1, "checkpoint", 4, 4),
        ("n1", 1, "checkpoint", 4, 4),
    ]
    totals = summarise([report]).total.totals
    assert (totals.recoveries, totals.lost_steps, totals.lost_steps_unknown) == (1, 4, 0)


def test_a_restart_not_chained_is_a_recovery_of_its_own(job_log: Any) -> None:
    """Without ``chained_from`` (a fault after the recovery ended, or an older log) a later
    restart keeps its own recovery and its own numbers."""
    log = checkpoint_restart(job_log())
    log.at(11.5, "migration_done", epoch=2, resolution="checkpoint", lost_steps=3, recomputed_steps=3)
    log.detected(20.0, "step_exited", "n1", epoch=2)
    log.at(
        20.5,
        "migration_started",
        epoch=3,
        failed=["n1"],
        spares=[],
        last_heartbeat=None,
        mode="restart-in-place",
    )
    log.at(20.6, "restarted", epoch=3, restarts=2, active=["n1", "s1"], spares=[], from_checkpoint=True)
    log.at(25.0, "migration_done", epoch=3, resolution="checkpoint", lost_steps=1, recomputed_steps=1)

    report = report_of(log)
    assert [(f.node, f.recovery, f.lost_steps) for f in report.faults] == [("n2", 1, None), ("n1", 2, 1)]
