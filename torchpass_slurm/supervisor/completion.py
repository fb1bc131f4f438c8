"""How a recovery in flight completes: the ranks' reports close its :class:`~.state.Migration`.

A live, planned or regroup recovery is done when rank 0 reports the new
epoch's first step; a checkpoint restart when rank 0 reports that it resumed.
Either writes ``migration_done`` with the steps lost (the survivors' highest
heartbeat step before the fault, minus the agreed or resumed step).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchpass_slurm import events as ev
from torchpass_slurm.faults import Resolution
from torchpass_slurm.supervisor.state import Clock, JobState, RunState

__all__ = ["Completion"]


class Completion:
    """Closes the job's recovery in flight from the ranks' reports."""

    def __init__(self, job: JobState, *, events: ev.EventLog, clock: Clock) -> None:
        self.job = job
        self.events = events
        self.clock = clock

    def agreed(self, epoch: object, committed_step: int) -> None:
        """Rank 0's agreement: the committed step every rank of the epoch now holds."""
        mig = self.job.migration
        if mig is not None and epoch == mig.epoch:
            mig.agreed = committed_step

    def first_step(self, fields: Mapping[str, Any]) -> None:
        """Rank 0 committed the new epoch's first step: a live recovery is done."""
        mig = self.job.migration
        if (
            mig is None
            or mig.resolution not in (Resolution.LIVE, Resolution.REGROUP)
            or fields.get("epoch", mig.epoch) != mig.epoch
        ):
            return
        lost = None if mig.committed is None or mig.agreed is None else max(0, mig.committed - mig.agreed)
        self.events.append(
            ev.MIGRATION_DONE,
            resolution=mig.resolution,
            lost_steps=lost,
            recomputed_steps=0 if mig.planned else 1,
            planned=mig.planned,
            failed=list(mig.failed),
            seconds=round(self.clock.time() - mig.started, 3),
        )
        self.job.migration = None
        self.job.state = RunState.RUNNING

    def resumed(self, fields: Mapping[str, Any]) -> None:
        """Rank 0 resumed from the checkpoint after a restart: the steps since it are lost."""
        mig = self.job.migration
        if mig is None or mig.resolution != Resolution.CHECKPOINT or fields.get("epoch") != mig.epoch:
            return
        resumed = int(fields.get("step", 0))
        lost = None if mig.committed is None else max(0, mig.committed - resumed)
        self.events.append(
            ev.MIGRATION_DONE,
            resolution=Resolution.CHECKPOINT,
            lost_steps=lost,
            recomputed_steps=lost,
            resumed_step=resumed,
            failed=list(mig.failed),
            seconds=round(self.clock.time() - mig.started, 3),
        )
        self.job.migration = None
