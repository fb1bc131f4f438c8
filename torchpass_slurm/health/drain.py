"""Drain etiquette: what drains, with which reason, and what may be undrained.

* A reason always starts with :data:`REASON_PREFIX` (``torchpass:``) and names
  the check and what it saw, so every drain can be explained.
* CRITICAL (the node is bad) drains. UNKNOWN (the check broke) drains only when
  the admin set ``drain_on_unknown``. WARNING never drains.
* Only nodes whose reason starts with the prefix are ever resumed; a node an
  admin drained for another reason is left alone and listed as skipped.

Decisions are pure (:func:`drain_reason`, :func:`plan_undrain`); the few
functions that act take a :class:`~torchpass_slurm.slurm.SlurmBackend`, the
only code that runs Slurm commands.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torchpass_slurm.faults import (
    DRAIN_REASON_PREFIX,
    MAX_DRAIN_REASON,
    drain_reason_text,
    is_pre_emptive_drain,
    pre_emptive_drain_reason,
)
from torchpass_slurm.health.checks import CheckResult, Status
from torchpass_slurm.health.config import HealthConfig
from torchpass_slurm.health.run import HealthReport
from torchpass_slurm.slurm import Node, SlurmBackend

logger = logging.getLogger(__name__)

__all__ = [
    "REASON_PREFIX",
    "MAX_REASON",
    "UndrainStep",
    "drain_reason",
    "drain_reason_text",
    "pre_emptive_drain_reason",
    "is_pre_emptive_drain",
    "is_ours",
    "plan_undrain",
    "undrain",
]

#: Every reason torchpass drains with starts with this; nothing else is ever undrained. The
#: reasons are built by :func:`~torchpass_slurm.faults.drain_reason_text` (in the vocabulary
#: floor, since the supervisor's planner and the report need it too, and may not import health/).
REASON_PREFIX = DRAIN_REASON_PREFIX
#: Slurm keeps long reasons, but sinfo shows few characters: keep them short.
MAX_REASON = MAX_DRAIN_REASON


def is_ours(reason: str | None) -> bool:
    """True when ``reason`` is one torchpass wrote."""
    return reason is not None and reason.strip().startswith(REASON_PREFIX)


def _describe(results: Sequence[CheckResult], lead: str = "") -> str:
    first = results[0]
    more = f" (+{len(results) - 1} more)" if len(results) > 1 else ""
    return drain_reason_text(f"{lead}{first.check}: {first.message}{more}")


def drain_reason(report: HealthReport, config: HealthConfig) -> str | None:
    """The reason to drain with, or None when this report must not drain the node."""
    critical = report.findings(Status.CRITICAL)
    if critical:
        return _describe(critical)
    unknown = report.findings(Status.UNKNOWN)
    if unknown and config.drain_on_unknown:
        return _describe(unknown, "check failed: ")
    return None


@dataclass(frozen=True)
class UndrainStep:
    """What ``tp health undrain`` does with one node: ``resume`` or ``skip`` (and why)."""

    node: str
    action: str
    why: str
    reason: str | None = None


def plan_undrain(nodes: Iterable[Node], wanted: Sequence[str] | None = None) -> list[UndrainStep]:
    """Resume drained nodes with a torchpass reason; list the rest (named or drained) as skipped."""
    steps: list[UndrainStep] = []
    known = {n.name: n for n in nodes}
    for name in wanted if wanted is not None else sorted(known):
        node = known.get(name)
        if node is None:
            steps.append(UndrainStep(name, "skip", "Slurm knows no such node"))
        elif not node.is_drain:
            if wanted is not None:
                steps.append(UndrainStep(name, "skip", f"not drained ({node.state_text})", node.reason))
        elif is_ours(node.reason):
            steps.append(UndrainStep(name, "resume", "drained by torchpass", node.reason))
        else:
            steps.append(UndrainStep(name, "skip", "drained for another reason (not torchpass)", node.reason))
    return steps


def undrain(slurm: SlurmBackend, steps: Sequence[UndrainStep], *, dry_run: bool = False) -> None:
    """Resume the nodes whose step says so (nothing when ``dry_run``)."""
    for step in steps:
        if step.action == "resume" and not dry_run:
            slurm.resume(step.node)
            logger.info("resumed %s (was: %s)", step.node, step.reason)
