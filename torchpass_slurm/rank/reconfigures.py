"""The reconfigures a rank heard from the supervisor and has not acted on yet.

The supervisor sends ``reconfigure`` for a new epoch: at once after a failure (the
recovery path waits for it), or ahead of time for a drain, as "switch after step S"
(:meth:`PendingReconfigures.switch_due`). A rank collects them without blocking at every
step boundary and takes the oldest of a newer epoch that fits; older ones are dropped.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

from torchpass_slurm.control.bodies import Reconfigure
from torchpass_slurm.rank.runtime import Runtime

__all__ = ["PendingReconfigures", "leave_if_fenced"]


def leave_if_fenced(rt: Runtime, step: int) -> None:
    """The supervisor told this rank to stop (its step was declared lost while it lived on:
    a healed partition, a frozen process that woke up): it must not train on, nor wait for
    an epoch it is no longer part of. Exits the process (status 1, with the reason)."""
    if rt.stop_requested.is_set():
        rt.log.error("fenced by the supervisor: leaving at step %d", step)
        raise SystemExit(f"torchpass: this rank was fenced by the supervisor at step {step}")


class PendingReconfigures:
    """The reconfigures of newer epochs this rank heard and has not taken, oldest first."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.pending: list[Reconfigure] = []

    def switch_due(self, step: int) -> Reconfigure | None:
        """A planned migration whose switch step this rank has committed (``step``), if any.

        The supervisor announces a drain as "switch after step S", S far enough
        ahead that every rank hears of it first, so no collective is needed to
        agree on it. A rank that heard too late finds its next collective
        failing (the others left the group) and joins the new epoch through
        the recovery path, at the step it committed last; the agreement there
        takes the highest step anyway.
        """
        self.collect()
        return self.take(lambda b: b.planned and (b.switch_after is None or step >= b.switch_after))

    def planned(self) -> Reconfigure | None:
        """A planned migration, whatever its switch step (the last step is committed)."""
        self.collect()
        return self.take(lambda b: b.planned)

    def take(self, wanted: Callable[[Reconfigure], bool]) -> Reconfigure | None:
        """The oldest pending reconfigure of a newer epoch that is ``wanted`` (taken, older dropped)."""
        for body in sorted(self.pending, key=lambda b: b.epoch):
            if body.epoch > self.rt.epoch and wanted(body):
                self.pending = [b for b in self.pending if b.epoch > body.epoch]
                return body
        return None

    def collect(self) -> None:
        """Every reconfigure the runtime has received so far (no wait)."""
        while True:
            body = self.rt.wait_reconfigure(datetime.timedelta(0))
            if body is None:
                return
            self.pending.append(body)

    def next(self, timeout: datetime.timedelta, step: int) -> Reconfigure | None:
        """The pending or next reconfigure for a newer epoch; None after ``timeout``. A rank
        fenced meanwhile leaves (:func:`leave_if_fenced`, at ``step``)."""
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            self.collect()
            body = self.take(lambda b: True)
            if body is not None:
                return body
            leave_if_fenced(self.rt, step)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            got = self.rt.wait_reconfigure(datetime.timedelta(seconds=min(left, 0.5)))
            if got is not None:
                self.pending.append(got)
