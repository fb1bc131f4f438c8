"""The job's device mesh, as the ranks report it: kept once, refused when it cannot be the job's.

A sharded rank reports its :class:`~torchpass_slurm.mesh.MeshLayout` in the ``mesh``
field of its ``live_ready`` (the control plane has checked that it is one). The planner
decides from it whether a lost rank's state survives in a replica
(:func:`~torchpass_slurm.supervisor.plan.plan_recovery`), so a layout that does not fit
the job is worse than none: it is refused, with the report that carried it, and the rank
is not counted as live (a loss that needs it falls back to a restart).
"""

from __future__ import annotations

import logging

from torchpass_slurm.control.bodies import Report
from torchpass_slurm.mesh import MeshLayout
from torchpass_slurm.rundir import events as ev
from torchpass_slurm.supervisor.state import JobState

__all__ = ["accept_mesh", "mesh_refusal"]

logger = logging.getLogger(__name__)


def mesh_refusal(kept: MeshLayout | None, mesh: MeshLayout, world_size: int) -> str | None:
    """Why ``mesh`` cannot be the job's (None: it can). Pure."""
    if mesh.world_size != world_size:
        return f"its {mesh.world_size} ranks are not the job's {world_size}"
    if kept is not None and mesh != kept:
        return f"it differs from the job's {kept.to_json()}"
    return None


def accept_mesh(job: JobState, events: ev.EventLog, node: str, report: Report) -> bool:
    """Keep the mesh of a ``live_ready`` (the first one becomes the job's, logged as ``mesh_layout``);
    False, with a warning, when it is refused."""
    mesh = report.mesh
    if mesh is None:
        return True
    why = mesh_refusal(job.layout, mesh, job.membership.world_size)
    if why is not None:
        logger.warning("refused the mesh %s of rank %s on %s: %s", mesh.to_json(), report.rank, node, why)
        return False
    if job.layout is None:
        job.mesh_reported(mesh)
        events.append(ev.MESH_LAYOUT, node=node, **mesh.to_json())
    return True
