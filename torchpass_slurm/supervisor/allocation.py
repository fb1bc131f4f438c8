"""The job's allocation: nodes the job no longer needs go back to Slurm while it runs.

A drained node leaves once its ranks handed over (it then becomes DRAINED, so
maintenance can start); a node that died or went silent leaves once its
recovery has started (left in, it would hold the finished job in COMPLETING
until Slurm declared it DOWN). Each node's ``node_released`` event says how
it went; a failed shrink leaves the node in the job until its end.
"""

from __future__ import annotations

import logging

from torchpass_slurm import events as ev
from torchpass_slurm.errors import SlurmError
from torchpass_slurm.slurm import SlurmBackend
from torchpass_slurm.supervisor.state import JobState

__all__ = ["Allocation"]

logger = logging.getLogger(__name__)


class Allocation:
    """Shrinks one job's allocation through Slurm."""

    def __init__(self, job: JobState, *, slurm: SlurmBackend, events: ev.EventLog) -> None:
        self.job = job
        self.slurm = slurm
        self.events = events

    def release(self, node: str) -> None:
        """A drained node's step has ended: give the node back to Slurm (it becomes DRAINED)."""
        self.job.releasing.discard(node)
        self.job.released.add(node)
        self.shrink_out([node], reason="drained")

    def shrink_out(self, nodes: list[str], *, reason: str) -> None:
        """Shrink the job to its other nodes; a NODE_RELEASED event per node says how it went."""
        try:
            keep = [n for n in self.slurm.job(self.job.job_id).nodes if n not in nodes]
            if keep:
                self.slurm.shrink_job(self.job.job_id, keep)
        except SlurmError as err:  # the nodes leave when the job ends instead
            logger.warning("could not release %s from job %s: %s", ",".join(nodes), self.job.job_id, err)
            for node in nodes:
                self.events.append(ev.NODE_RELEASED, node=node, released=False, reason=reason, error=str(err))
            return
        for node in nodes:
            self.events.append(ev.NODE_RELEASED, node=node, released=True, reason=reason)
