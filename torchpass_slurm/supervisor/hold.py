"""No spare at this moment is not the end: the job holds its committed step while the pool refills.

A rank is lost, no spare is left, but a replica still holds the lost rank's
state and the spare pool can ask Slurm for a node (``supervisor/refill.py``).
Giving up would throw that state away, so the plan is ``hold``
(``supervisor/plan.py``): the lost step is stopped and recorded as any loss,
the survivors, whose collective failed, keep their processes and the
committed step in memory and wait for their reconfigure, and the pool asks
for a node for each held loss on top of its target. The planner holds only
when no lost node can be its own spare (a node that only lost its rank takes
it back live in place) and no restart in place is possible. A loss during a
live recovery in flight is held the same way (the stalled-recovery timeout
waits while the job holds).

Each loop pass, :func:`due` says when to hand the held faults back to the planner: once
the pool holds a spare for each of them (the move is then live, its
``migration_started`` says how long it was held: ``held_s``), or once
``spare_wait`` is over (the planner no longer holds: a restart in place
where every lost node outlived its fault, else the job ends). A fault that
comes meanwhile is planned together with the held ones; the wait keeps its
first deadline.

The ranks wait for their reconfigure ``spare_wait`` longer than they would
otherwise (``rank/elastic.py``); ``tp run`` exports the setting to them.
"""

from __future__ import annotations

import logging

from torchpass_slurm.faults import Fault
from torchpass_slurm.rundir import events as ev
from torchpass_slurm.supervisor.state import Clock, Holding, JobState, RunState

__all__ = ["begin", "due", "held_faults"]

logger = logging.getLogger(__name__)


def begin(
    job: JobState, lost: tuple[Fault, ...], detail: str, events: ev.EventLog, spare_wait: float, clock: Clock
) -> None:
    """Hold for ``lost`` (a plan's ``hold``): up to ``spare_wait`` s from the first held loss on;
    a loss during the hold joins it, with the same deadline. ``holding`` says so, once a loss."""
    held = job.holding
    new = tuple(f for f in lost if held is None or f not in held.faults)
    holding = (
        Holding(lost, clock.time(), clock.monotonic() + spare_wait, spare_wait)
        if held is None
        else held.widened(lost)
    )
    job.hold(holding)
    if new:
        left = round(holding.until - clock.monotonic(), 3)
        events.append(ev.HOLDING, failed=[f.node for f in new], wait_s=left, detail=detail)
        logger.warning("%s", detail)
    job.enter(RunState.RECOVERING)


def due(job: JobState, clock: Clock) -> bool:
    """The held losses go back to the planner now: a spare is in the pool for each, or the wait
    is over."""
    held = job.holding
    if held is None:
        return False
    return len(job.membership.spares) >= len(held.faults) or clock.monotonic() >= held.until


def held_faults(job: JobState) -> list[Fault]:
    """The losses the job holds for, planned again with any new fault."""
    return list(job.holding.faults) if job.holding is not None else []
