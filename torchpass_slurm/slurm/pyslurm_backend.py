"""An optional backend over pyslurm, for reads that should not fork a process.

pyslurm binds to ONE Slurm release: pyslurm 25.11.x works only with Slurm
25.11. :func:`~torchpass_slurm.slurm.backend.select_backend` therefore picks
this class only when ``import pyslurm`` works and its version has the same
major.minor as the running Slurm; everywhere else the CLI backend is used.

Only the hot read paths (node listing, :meth:`job`) go through pyslurm; every
other operation is inherited from :class:`CliSlurm`, so both backends behave
the same. The attribute names used here (``Nodes.load()``, ``Node.state``,
``Node.reason``, ``Node.partitions``, ``Node.total_cpus``, ``Job.load()``,
``Job.state``, ``Job.nodes``, ...) follow pyslurm 25.11's documented API but
have NOT been run against a real pyslurm: no Slurm 25.11 exists where this
was written. See docs/slurm-layer.md.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

from torchpass_slurm.slurm.cli_backend import CliSlurm
from torchpass_slurm.slurm.models import Job, Node
from torchpass_slurm.slurm.parse import expand_nodelist, reason_text, split_state
from torchpass_slurm.slurm.runner import Runner

logger = logging.getLogger(__name__)

__all__ = ["PyslurmSlurm"]


class PyslurmSlurm(CliSlurm):
    """:class:`CliSlurm` whose node and job reads go through the pyslurm library."""

    name = "pyslurm"

    def __init__(self, pyslurm: ModuleType, runner: Runner | None = None) -> None:
        super().__init__(runner)
        self.pyslurm = pyslurm

    def _load_nodes(self) -> tuple[Node, ...]:
        return tuple(_node(n) for n in self.pyslurm.Nodes.load().values())

    def job(self, job_id: int) -> Job:
        return _job(self.pyslurm.Job.load(job_id))


def _node(obj: Any) -> Node:
    state, flags = split_state(str(obj.state), "pyslurm Node.state")
    return Node(
        name=str(obj.name),
        state=state,
        flags=flags,
        reason=getattr(obj, "reason", None) or None,
        partitions=tuple(getattr(obj, "partitions", None) or ()),
        cpus=getattr(obj, "total_cpus", None),
    )


def _job(obj: Any) -> Job:
    state, flags = split_state(str(obj.state), "pyslurm Job.state")
    return Job(
        job_id=int(obj.id),
        name=str(getattr(obj, "name", "") or ""),
        state=state,
        flags=flags,
        nodes=expand_nodelist(str(getattr(obj, "nodes", "") or ""), "pyslurm Job.nodes"),
        batch_host=getattr(obj, "batch_host", None) or None,
        partition=getattr(obj, "partition", None) or None,
        reason=reason_text(getattr(obj, "state_reason", None)),
        num_nodes=getattr(obj, "num_nodes", None),
        comment=getattr(obj, "comment", None) or None,
        std_out=getattr(obj, "standard_output", None) or None,
        work_dir=getattr(obj, "working_directory", None) or None,
    )
