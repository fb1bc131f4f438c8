"""The job's allocation: nodes the job no longer needs go back to Slurm while it runs.

A drained node leaves once its ranks handed over (it then becomes DRAINED, so
maintenance can start); a node that died or went silent leaves once its
recovery has started (left in, it would hold the finished job in COMPLETING
until Slurm declared it DOWN). Each node's ``node_released`` event says how
it went; a failed shrink leaves the node in the job until its end.

The shrinks run on a thread of their own, one at a time, never on the loop's:
Slurm 22.05 held a refused shrink ("the DB index is being set") 5-10 s before
it answered, and meanwhile the loop read no message and wrote no status. The
loop logs what they did (:meth:`Allocation.collect`, every pass) and waits
for the last ones at its end (:meth:`Allocation.close`).

Slurm says when a refusal is only for now ("try again in a bit": the job's
database index is not set yet, just after it started): such a shrink is tried
again after :data:`RETRY_DELAYS_S`, until the job ends. In the fault campaign
on Slurm 22.05, 23 of the released nodes were refused that way and stayed in
their job until it ended. A lost node Slurm refused is ``unreleased``: in the
allocation still, the spare pool may take it back once it is alive again
(``supervisor/refill.py``), and its shrink is then dropped (:meth:`Allocation.rejoined`).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from torchpass_slurm.errors import SlurmError
from torchpass_slurm.rundir import events as ev
from torchpass_slurm.supervisor.context import JobContext

__all__ = ["Allocation", "CLOSE_TIMEOUT_S"]

logger = logging.getLogger(__name__)

#: Seconds :meth:`Allocation.close` waits for the shrinks still running (scontrol's own
#: timeout is shorter); those still running are not logged.
CLOSE_TIMEOUT_S = 30.0

#: Seconds before each new try of a shrink that Slurm refused for now; then it is given up.
RETRY_DELAYS_S = (2.0, 4.0, 8.0, 16.0)
#: What Slurm says when a refusal is only for now.
TRY_AGAIN = "try again"

#: (nodes, reason) to shrink out; None ends the thread
_Order = tuple[list[str], str] | None


class Allocation:
    """Shrinks one job's allocation through Slurm, off the loop's thread."""

    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx
        self.job = ctx.job
        self._orders: queue.SimpleQueue[_Order] = queue.SimpleQueue()
        #: (nodes, reason, the error, or None when they left)
        self._outcomes: queue.SimpleQueue[tuple[list[str], str, str | None]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        #: set by close(): a shrink in flight gets no more tries
        self._closing = threading.Event()
        self.pending = 0
        #: nodes already asked out: a plan made again after a hold names its losses again
        self._asked: set[str] = set()
        #: nodes the job took back while their shrink waited to be tried again
        self._rejoined: set[str] = set()

    def release(self, node: str) -> None:
        """A drained node's step has ended: give the node back to Slurm (it becomes DRAINED)."""
        self.job.node_released(node)
        self.shrink_out([node], reason="drained")

    def shrink_out(self, nodes: list[str], *, reason: str) -> None:
        """Shrink the job to its other nodes, on the shrink thread; :meth:`collect` logs a
        NODE_RELEASED event per node once it is done. A node asked out before is not asked
        again: a plan made again after a hold (``supervisor/hold.py``) names its losses again."""
        nodes = [n for n in nodes if n not in self._asked]
        if not nodes:
            return
        self._asked.update(nodes)
        self._rejoined.difference_update(nodes)
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="torchpass-shrink", daemon=True)
            self._thread.start()
        self.pending += 1
        self._orders.put((list(nodes), reason))

    def rejoined(self, node: str) -> None:
        """``node`` is the job's again (a refill merged it): a later loss releases it again
        (measured: a node lost, refilled, then lost again stayed in the job, and the spare
        pool, which excludes the job's nodes, found no node for 70 s)."""
        self._asked.discard(node)
        self._rejoined.add(node)
        self.job.node_rejoined(node)

    def collect(self) -> None:
        """Log the shrinks that are done (on the loop's thread, which owns the event log)."""
        while True:
            try:
                nodes, reason, error = self._outcomes.get_nowait()
            except queue.Empty:
                return
            self.pending -= 1
            for node in nodes:
                extra: dict[str, Any] = {} if error is None else {"error": error}
                self.ctx.events.append(
                    ev.NODE_RELEASED, node=node, released=error is None, reason=reason, **extra
                )

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Wait up to ``timeout`` for the shrinks still running, log them, end the thread."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._closing.set()
        self._orders.put(None)
        thread.join(timeout)
        if thread.is_alive():
            logger.warning(
                "a shrink of job %s is still running after %.0f s: not waited for", self.job.job_id, timeout
            )
        self.collect()

    def _work(self) -> None:
        while (order := self._orders.get()) is not None:
            nodes, reason = order
            self._outcomes.put((nodes, reason, self._shrink(nodes)))

    def _shrink(self, nodes: list[str]) -> str | None:
        """Shrink the job to its nodes but ``nodes``, tried again while Slurm says to; the
        error, or None."""
        delays = iter(RETRY_DELAYS_S)
        try:
            while True:
                if all(n in self._rejoined for n in nodes):
                    return "taken back into the job before Slurm would release it"
                try:
                    held = self.ctx.slurm.job(self.job.job_id).nodes
                    keep = [n for n in held if n not in nodes]
                    if keep and len(keep) < len(held):  # never a shrink that changes nothing
                        self.ctx.slurm.shrink_job(self.job.job_id, keep)
                    return None
                except SlurmError as err:
                    delay = next(delays, None) if TRY_AGAIN in str(err) else None
                    # in the allocation still: the spare pool may take it back in place
                    self.job.nodes_unreleased([n for n in nodes if n not in self._rejoined])
                    if delay is None or self._closing.wait(delay):
                        raise
                    logger.info("Slurm cannot release %s yet; again in %.0f s", ",".join(nodes), delay)
        except SlurmError as err:  # the nodes leave when the job ends instead
            logger.warning("could not release %s from job %s: %s", ",".join(nodes), self.job.job_id, err)
            return str(err)
        except Exception as err:  # deliberately broad: the thread must report, not die silently
            logger.exception("releasing %s from job %s failed", ",".join(nodes), self.job.job_id)
            return repr(err)
