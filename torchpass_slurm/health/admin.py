"""What the Slurm hooks do with a report: Prolog/Epilog and HealthCheckProgram.

Prolog / Epilog (run by slurmd as root, per job): on a drain-worthy report
(:func:`~torchpass_slurm.health.drain.drain_reason`) drain the node once with
the ``torchpass:`` reason (``prolog_drain = "scontrol"``, the default) and exit
1, so slurmd requeues the job (held) and it runs elsewhere. With
``prolog_drain = "slurmd"`` no Slurm command is run at all: the exit status
alone makes slurmd drain the node ("Prolog error") and the reason goes only to
stderr/syslog. Anything else exits 0: a WARNING or a broken check never costs
a job its start.

HealthCheckProgram (:func:`node_check`, run periodically): drains the node
itself (Slurm does not), never overwrites an admin's own drain, and with
``auto_resume`` resumes the node once it is OK again if, and only if, its
reason is still a torchpass one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from torchpass_slurm.errors import SlurmError
from torchpass_slurm.health.checks import Status
from torchpass_slurm.health.config import HealthConfig
from torchpass_slurm.health.drain import drain_reason, is_ours
from torchpass_slurm.health.run import HealthReport
from torchpass_slurm.health.state import drained_marker, set_drained_marker
from torchpass_slurm.slurm import SlurmBackend

logger = logging.getLogger(__name__)

__all__ = ["HookOutcome", "node_check", "prolog"]

#: Exit status of a Prolog/Epilog that wants the node drained and the job moved.
EXIT_DRAIN = 1


@dataclass(frozen=True)
class HookOutcome:
    """The exit status, and the one line for stderr/syslog (None: stay quiet)."""

    exit_code: int
    message: str | None = None
    drained: bool = False


def _summary(report: HealthReport) -> str:
    bad = [r for r in report.results if r.status != Status.OK]
    lines = "; ".join(f"{r.status.name} {r.check}: {r.message}" for r in bad[:3])
    return f"{report.node} {report.status.name}: {lines}" if lines else f"{report.node} OK"


def prolog(report: HealthReport, config: HealthConfig, slurm: Callable[[], SlurmBackend]) -> HookOutcome:
    """Prolog and Epilog: drain once on a drain-worthy report and fail the hook; else pass quietly."""
    reason = drain_reason(report, config)
    if reason is None:
        quiet = report.status == Status.OK
        return HookOutcome(0, None if quiet else f"torchpass: {_summary(report)} (not drained)")
    if config.prolog_drain == "slurmd":
        return HookOutcome(EXIT_DRAIN, f"{reason} (slurmd drains the node)")
    try:
        slurm().drain(report.node, reason)
    except SlurmError as err:
        return HookOutcome(EXIT_DRAIN, f"{reason}; draining failed ({err.message}), slurmd drains the node")
    return HookOutcome(EXIT_DRAIN, f"drained {report.node}: {reason}", drained=True)


def node_check(
    report: HealthReport, config: HealthConfig, slurm: Callable[[], SlurmBackend], *, now: float
) -> HookOutcome:
    """HealthCheckProgram: drain on a drain-worthy report, resume (if enabled) when OK again.

    Slurm is asked about the node only on these two rare paths, never on a
    plain OK run, so a cluster of many nodes adds no load on slurmctld.
    """
    code = int(report.status)
    reason = drain_reason(report, config)
    try:
        if reason is not None:
            return _drain_once(report, config, slurm(), reason, code, now)
        if report.status == Status.OK and config.auto_resume and drained_marker(config.state_file):
            return _resume_if_ours(report, config, slurm(), code, now)
    except SlurmError as err:
        return HookOutcome(Status.UNKNOWN.value, f"torchpass: {report.node}: Slurm failed: {err.message}")
    if report.status == Status.OK:
        return HookOutcome(code)
    return HookOutcome(code, f"torchpass: {_summary(report)} (not drained)")


def _drain_once(
    report: HealthReport, config: HealthConfig, slurm: SlurmBackend, reason: str, code: int, now: float
) -> HookOutcome:
    node = slurm.node(report.node)
    if node.is_drain:
        whose = "torchpass" if is_ours(node.reason) else "an admin"
        return HookOutcome(code, f"{reason} (already drained by {whose}: {node.reason!r}; left as is)")
    slurm.drain(report.node, reason)
    set_drained_marker(config.state_file, reason, now)
    return HookOutcome(code, f"drained {report.node}: {reason}", drained=True)


def _resume_if_ours(
    report: HealthReport, config: HealthConfig, slurm: SlurmBackend, code: int, now: float
) -> HookOutcome:
    node = slurm.node(report.node)
    set_drained_marker(config.state_file, None, now)
    if node.is_drain and is_ours(node.reason):
        slurm.resume(report.node)
        return HookOutcome(code, f"torchpass: resumed {report.node}, OK again (was: {node.reason})")
    return HookOutcome(code)
