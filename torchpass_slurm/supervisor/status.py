"""The supervisor's side of the status file: the snapshot of its state at one moment.

The file itself (its format, the atomic write, the reader) is
:mod:`torchpass_slurm.rundir.status`; the loop writes one snapshot about once a
second.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from torchpass_slurm.config import NodeRole
from torchpass_slurm.rundir.status import JobStatus, NodeStatus

if TYPE_CHECKING:
    from torchpass_slurm.supervisor.state import JobState

__all__ = ["job_status"]


def job_status(job: JobState, run_dir: Path, now: float, transport: str = "auto") -> JobStatus:
    """The snapshot of ``job`` at unix time ``now``; ``transport``: what carries its live
    migrations' state (TORCHPASS_TRANSPORT)."""
    m = job.membership
    # the membership's roles and ranks by node, looked up once (not a scan of it per node:
    # at 2,048 nodes that took a quarter of a second, once a second)
    slots = {node: slot for slot, node in enumerate(m.active)}
    roles = {**dict.fromkeys(m.failed, NodeRole.FAILED), **dict.fromkeys(m.spares, NodeRole.SPARE)}
    roles.update(dict.fromkeys(m.active, NodeRole.ACTIVE))
    k = m.ntasks_per_node
    nodes = []
    for node, step in job.steps.items():
        role = roles.get(node, step.role)
        if node in job.released or node in job.releasing:
            role = NodeRole.RELEASED
        nodes.append(
            NodeStatus(
                node=node,
                role=role,
                ranks=tuple(range(slots[node] * k, slots[node] * k + k)) if role == NodeRole.ACTIVE else (),
                state=step.state.value,
                last_step=step.last_step,
                last_heartbeat=step.last_heartbeat,
                exit_code=step.exit_code,
            )
        )
    return JobStatus(
        job_id=str(job.job_id),
        run_dir=str(run_dir),
        state=job.state.value,
        epoch=m.epoch,
        world_size=m.world_size,
        updated=now,
        nodes=tuple(nodes),
        restarts=job.restarts,
        message=job.message,
        holding=tuple(job.holding.nodes) if job.holding else (),
        holding_until=job.holding.since + job.holding.wait_s if job.holding else None,
        transport=transport,
    )
