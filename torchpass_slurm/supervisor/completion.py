"""How a recovery in flight completes: the ranks' reports close its :class:`~.state.Migration`.

A live, planned or regroup recovery is done when rank 0 reports the new
epoch's first step; a checkpoint restart when rank 0 reports that it resumed.
Either writes ``migration_done`` with the steps lost (the survivors' highest
heartbeat step before the fault, minus the agreed or resumed step).

A recovery can also end with the training: a drain seen in the job's last steps
announces a switch step at or past the last one. When the ranks switched after the last
step (``rank/elastic.py`` switches then), no first step follows, and the recovery is
closed when the training completes, as ``live`` with ``at_end``. When the training ended
before any rank switched, the drained node kept its ranks to the end and the promoted
spare waits for a group that will never form: the move is closed as ``deferred`` (0
steps lost, nothing moved), and the spare is not waited for (:meth:`Completion.unswitched`).
"""

from __future__ import annotations

from typing import Any

from torchpass_slurm.control.reports import FirstStep, Resumed
from torchpass_slurm.faults import Resolution
from torchpass_slurm.rundir import events as ev
from torchpass_slurm.supervisor.context import JobContext
from torchpass_slurm.supervisor.state import RunState

__all__ = ["Completion"]


class Completion:
    """Closes the job's recovery in flight from the ranks' reports."""

    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx
        self.job = ctx.job

    def agreed(self, epoch: object, committed_step: int) -> None:
        """Rank 0's agreement: the committed step every rank of the epoch now holds."""
        self.job.recovery_agreed(epoch, committed_step)

    def first_step(self, report: FirstStep) -> None:
        """Rank 0 committed the new epoch's first step: a live recovery is done."""
        mig = self.job.migration
        if (
            mig is None
            or mig.resolution not in (Resolution.LIVE, Resolution.REGROUP)
            or report.epoch != mig.epoch
        ):
            return
        self._done(mig.resolution, self._lost(), 0 if mig.planned else 1)
        self.job.enter(RunState.RUNNING)

    def released(self) -> None:
        """A leaving rank of the planned migration handed over and left: the switch came."""
        self.job.leaving_ranks_left()

    def unswitched(self) -> tuple[str, ...]:
        """The spares a planned migration promoted while no rank has switched yet (no leaving
        rank released, no agreement in the new epoch): they wait for the switch step."""
        mig = self.job.migration
        if mig is None or not mig.planned or mig.left or mig.agreed is not None:
            return ()
        return mig.promoted

    def training_ended(self) -> None:
        """Every rank's training completed with a recovery in flight: close it (see the module
        docstring). A checkpoint restart in flight is left to ``resumed``."""
        mig = self.job.migration
        if mig is None or mig.resolution == Resolution.CHECKPOINT:
            return
        if self.unswitched():
            self._done(Resolution.DEFERRED, 0, 0, detail="the training ended before the switch step")
        else:
            self._done(mig.resolution, self._lost(), 0, at_end=True)

    def _lost(self) -> int | None:
        mig = self.job.migration
        assert mig is not None
        return None if mig.committed is None or mig.agreed is None else max(0, mig.committed - mig.agreed)

    def _done(self, resolution: Resolution, lost: int | None, recomputed: int | None, **extra: Any) -> None:
        mig = self.job.migration
        assert mig is not None
        self.ctx.events.append(
            ev.MIGRATION_DONE,
            resolution=resolution,
            lost_steps=lost,
            recomputed_steps=recomputed,
            planned=mig.planned,
            failed=list(mig.failed),
            seconds=round(self.ctx.clock.time() - mig.started, 3),
            **extra,
        )
        self.job.recovery_ended()

    def resumed(self, report: Resumed) -> None:
        """Rank 0 resumed from the checkpoint after a restart: the steps since it are lost."""
        mig = self.job.migration
        if mig is None or mig.resolution != Resolution.CHECKPOINT or report.epoch != mig.epoch:
            return
        resumed = report.step
        lost = None if mig.committed is None else max(0, mig.committed - resumed)
        self._done(Resolution.CHECKPOINT, lost, lost, resumed_step=resumed)
