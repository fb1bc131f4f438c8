"""Fault classes: planned and pre-emptive migrations, deferred drains, and the totals per class."""

from __future__ import annotations

from typing import Any

import pytest

from torchpass_slurm.analysis.report import Phases
from torchpass_slurm.analysis.report_totals import ClassSummary, Totals, summarise, summary_line

from .conftest import ECC, NO_MIGRATION, PRE_EMPTIVE, T0, every_class
from .test_analyse import report_of


def moved(decision: float) -> Phases:
    """The phases of a drain moved by conftest's ``migration``, ``decision`` s after its mark."""
    return Phases(
        detection=None,
        decision=decision,
        rebuild=0.75,
        agreement=0.25,
        transfer=1.0,
        first_step=0.5,
        total=decision + 2.5,
    )


def test_an_admin_drain_is_a_planned_migration(job_log: Any) -> None:
    log = job_log()
    log.started(["n1", "n2"], ["s1"])
    log.at(20.0, "drain_seen", node="n2", reason="firmware update")
    log.migration(21.0, 2, ["n2"], ["s1"], last_heartbeat=None, reason="firmware update")
    (fault,) = report_of(log).faults
    assert (fault.fault_class, fault.node, fault.kind, fault.detector, fault.detail, fault.exit_code) == (
        "planned",
        "n2",
        "drain_seen",
        "drain",
        "firmware update",
        None,
    )
    assert (fault.ts, fault.recovery, fault.resolution, fault.lost_steps, fault.recomputed_steps) == (
        T0 + 20.0,
        1,
        "live",
        0,
        0,
    )
    assert fault.phases == moved(decision=1.0)


def test_a_drain_on_a_health_warning_is_pre_emptive_from_the_warning_on(job_log: Any) -> None:
    log = job_log()
    log.started(["n1", "n2"], ["s1"])
    log.at(30.0, "health_warning", node="n2", status="WARNING", summary=ECC)
    log.at(33.0, "drain_seen", node="n2", reason=PRE_EMPTIVE)
    log.migration(33.5, 2, ["n2"], ["s1"], last_heartbeat=None, reason=PRE_EMPTIVE)
    (fault,) = report_of(log).faults
    assert (fault.fault_class, fault.kind, fault.detector, fault.detail, fault.ts) == (
        "pre-emptive",
        "health_warning",
        "health",
        PRE_EMPTIVE,
        T0 + 30.0,
    )
    assert fault.phases == moved(decision=3.5)


@pytest.mark.parametrize(
    ("warned_at", "drained_at", "expected"),
    [
        (5.0, 8.0, ("pre-emptive", "health", 5.0)),  # an admin's drain of a node that had warned
        (8.0, 5.0, ("planned", "drain", 5.0)),  # a warning after the drain is not what caused it
    ],
)
def test_a_health_warning_before_the_drain_makes_it_pre_emptive(
    job_log: Any, warned_at: float, drained_at: float, expected: tuple[str, str, float]
) -> None:
    log = job_log()
    log.started(["n1", "n2"], ["s1"])
    for t, kind, fields in sorted(
        [
            (warned_at, "health_warning", dict(node="n2", status="CRITICAL", summary="GPU 0 at 92 C")),
            (drained_at, "drain_seen", dict(node="n2", reason="ops: hot GPU")),
        ]
    ):
        log.at(t, kind, **fields)
    log.migration(8.5, 2, ["n2"], ["s1"], last_heartbeat=None, reason="ops: hot GPU")
    (fault,) = report_of(log).faults
    assert (fault.fault_class, fault.detector, fault.ts - T0) == expected
    assert fault.phases == moved(decision=8.5 - expected[2])


def test_a_deferred_drain_loses_nothing(job_log: Any) -> None:
    log = job_log()
    log.started(["n1", "n2"], [])
    log.at(10.0, "drain_seen", node="n1", reason="maintenance")
    log.at(10.5, "drain_deferred", node="n1", reason="maintenance", detail=NO_MIGRATION)
    log.at(30.0, "finished", exit_code=0, message="training done", restarts=0)
    report = report_of(log)
    (fault,) = report.faults
    assert (fault.fault_class, fault.kind, fault.detector, fault.ts, fault.detail) == (
        "planned",
        "drain_seen",
        "drain",
        T0 + 10.0,
        f"maintenance (deferred: {NO_MIGRATION})",
    )
    assert (fault.recovery, fault.resolution, fault.lost_steps, fault.recomputed_steps) == (
        1,
        "deferred",
        0,
        0,
    )
    assert fault.phases == Phases()  # no migration: nothing to measure
    assert summary_line(summarise([report])) == (
        "1 of 1 fault deferred to the end of the job with 0 committed steps lost (100% with no lost progress)"
    )


def test_the_jobs_own_drain_reason_makes_it_pre_emptive(job_log: Any) -> None:
    """The health_warning is not in the log (an older log): the reason still says who drained."""
    log = job_log()
    log.started(["n1", "n2"], [])
    log.at(5.0, "drain_seen", node="n2", reason=PRE_EMPTIVE)
    log.at(5.5, "drain_deferred", node="n2", reason=PRE_EMPTIVE, detail=NO_MIGRATION)
    (fault,) = report_of(log).faults
    assert (fault.fault_class, fault.detector, fault.ts, fault.resolution) == (
        "pre-emptive",
        "drain",
        T0 + 5.0,
        "deferred",
    )


def test_a_planned_migration_without_its_drain_seen_has_no_decision(job_log: Any) -> None:
    log = job_log()
    log.started(["n1", "n2"], ["s1"])
    log.migration(21.0, 2, ["n2"], ["s1"], last_heartbeat=None, reason="firmware update")
    (fault,) = report_of(log).faults
    assert (fault.fault_class, fault.kind, fault.ts) == ("planned", "migration_started", T0 + 21.0)
    assert fault.phases == Phases(rebuild=0.75, agreement=0.25, transfer=1.0, first_step=0.5)


def test_drains_that_cost_the_job_nothing_are_no_faults(job_log: Any) -> None:
    """A drained spare is a spare fault; a drain the job never acted on (it ended first) is not counted."""
    log = job_log()
    log.started(["n1", "n2"], ["s1"])
    log.at(5.0, "drain_seen", node="s1", reason="firmware update")
    log.at(5.5, "spare_lost", epoch=2, node="s1", reason="drained: firmware update", spares_left=0)
    log.at(8.0, "drain_seen", node="n1", reason="firmware update")
    log.at(9.0, "finished", exit_code=0, message="training done", restarts=0)
    report = report_of(log)
    assert report.faults == ()
    assert [(s.node, s.detector) for s in report.spare_faults] == [("s1", "spare_lost")]


def test_a_drained_node_that_has_left_gives_no_more_faults(job_log: Any) -> None:
    log = job_log()
    log.started(["n1", "n2"], ["s1"])
    log.at(20.0, "drain_seen", node="n2", reason="firmware update")
    log.migration(21.0, 2, ["n2"], ["s1"], last_heartbeat=None, reason="firmware update")
    log.detected(40.0, "node_down", "n2")  # rebooted for its maintenance, after it left
    assert [f.fault_class for f in report_of(log).faults] == ["planned"]


def test_an_unplanned_fault_during_a_planned_migration_joins_it(job_log: Any) -> None:
    """One recovery for both: its steps count once, in the class of the drain that opened it."""
    log = job_log()
    log.started(["n1", "n2", "n3"], ["s1", "s2"])
    log.at(20.0, "drain_seen", node="n2", reason="firmware update")
    log.at(
        21.0,
        "migration_started",
        epoch=2,
        failed=["n2"],
        spares=["s1"],
        last_heartbeat=None,
        mode="planned",
        reason="firmware update",
    )
    log.detected(22.0, "heartbeat_lost", "n3")
    log.at(
        22.5,
        "migration_started",
        epoch=3,
        failed=["n3"],
        spares=["s2"],
        last_heartbeat=T0 + 19.0,
        mode="live",
    )
    log.at(23.0, "group_rebuilt", epoch=3, seconds=0.5)
    log.at(23.5, "agreement", epoch=3, committed_step=100)
    log.at(24.0, "transfer_done", epoch=3, donor=0, receiver=4, bytes=1024, seconds=0.5, retries=0)
    log.at(24.5, "first_step", epoch=3, step=101)
    log.at(
        24.6, "migration_done", epoch=3, resolution="live", lost_steps=0, recomputed_steps=1, planned=False
    )
    report = report_of(log)
    assert [
        (f.fault_class, f.node, f.recovery, f.resolution, f.lost_steps, f.recomputed_steps)
        for f in report.faults
    ] == [("planned", "n2", 1, "live", 0, 1), ("unplanned", "n3", 1, "live", 0, 1)]
    assert report.faults[0].phases == Phases(
        decision=1.0, rebuild=2.0, agreement=0.5, transfer=0.5, first_step=0.5, total=4.5
    )
    # n3's heartbeats were lost after the recovery's start: it has no detection and no decision
    assert report.faults[1].phases == Phases(
        rebuild=2.0, agreement=0.5, transfer=0.5, first_step=0.5, total=2.5
    )
    summary = summarise([report])
    assert summary.by_class == {
        "planned": ClassSummary(Totals(faults=1, recoveries=1, recomputed_steps=1), 1, {"live": 1}),
        "unplanned": ClassSummary(Totals(faults=1, recoveries=0), 1, {"live": 1}),
    }
    assert summary.total == ClassSummary(Totals(faults=2, recoveries=1, recomputed_steps=1), 2, {"live": 2})


def test_one_fault_of_each_class(job_log: Any) -> None:
    report = report_of(every_class(job_log()))
    assert [
        (
            f.fault_class,
            f.node,
            f.kind,
            f.detector,
            f.ts - T0,
            f.recovery,
            f.resolution,
            f.lost_steps,
            f.recomputed_steps,
        )
        for f in report.faults
    ] == [
        ("unplanned", "n2", "heartbeat_lost", "heartbeat_lost", 10.0, 1, "live", 0, 1),
        ("pre-emptive", "n3", "health_warning", "health", 30.0, 2, "live", 0, 0),
        ("planned", "n1", "drain_seen", "drain", 50.0, 3, "deferred", 0, 0),
    ]
    assert [f.phases for f in report.faults] == [
        Phases(
            detection=3.0, decision=0.5, rebuild=0.75, agreement=0.25, transfer=1.0, first_step=0.5, total=3.0
        ),
        moved(decision=3.5),
        Phases(),
    ]
    summary = summarise([report])
    assert list(summary.by_class) == ["unplanned", "pre-emptive", "planned"]  # the order of CLASSES
    assert summary.by_class["unplanned"] == ClassSummary(
        Totals(faults=1, recoveries=1, recomputed_steps=1), 1, {"live": 1}
    )
    assert summary.by_class["pre-emptive"] == ClassSummary(Totals(faults=1, recoveries=1), 1, {"live": 1})
    assert summary.by_class["planned"] == ClassSummary(Totals(faults=1, recoveries=1), 1, {"deferred": 1})
    assert summary.total == ClassSummary(
        Totals(faults=3, recoveries=3, recomputed_steps=1), 3, {"live": 2, "deferred": 1}
    )
    assert summary.total.share_no_lost_progress == 1.0
    assert summary_line(summary) == (
        "2 of 3 faults resolved by live migration with 0 committed steps lost; 1 deferred to the end of the "
        "job with 0 committed steps lost (100% with no lost progress)"
    )
