"""The Slurm access layer: the only code in torchpass that runs Slurm commands.

Public API::

    from torchpass_slurm.slurm import select_backend, Node, Job

    slurm = select_backend()            # CliSlurm, or PyslurmSlurm when it matches
    for node in slurm.nodes():
        if node.is_drain: ...
    job = slurm.job(42)                 # job.nodes: the CURRENT node list
    slurm.shrink_job(42, keep_nodes=["n1", "n3"])

Pure helpers (no Slurm needed): :func:`expand` / :func:`compress` for
hostlists, :func:`parse_sinfo_json`, :func:`parse_squeue_json`,
:func:`parse_scontrol_job`, :func:`srun_argv`. See docs/slurm-layer.md.
"""

from __future__ import annotations

from torchpass_slurm.slurm.backend import BACKEND_ENV, SlurmBackend, pyslurm_matches, select_backend
from torchpass_slurm.slurm.cli_backend import CliSlurm
from torchpass_slurm.slurm.hostlist import compress, expand
from torchpass_slurm.slurm.models import Job, Node, SlurmVersion
from torchpass_slurm.slurm.parse import (
    parse_job_id,
    parse_sinfo_json,
    parse_squeue_json,
    parse_version,
)
from torchpass_slurm.slurm.runner import (
    DEFAULT_TIMEOUT_S,
    TIMEOUT_ENV,
    CommandResult,
    Runner,
    SubprocessRunner,
    default_timeout,
)
from torchpass_slurm.slurm.scontrol_text import parse_scontrol_job, parse_scontrol_nodes
from torchpass_slurm.slurm.steps import StepRequest, srun_argv, step_env

__all__ = [
    "BACKEND_ENV",
    "DEFAULT_TIMEOUT_S",
    "TIMEOUT_ENV",
    "CliSlurm",
    "CommandResult",
    "Job",
    "Node",
    "Runner",
    "SlurmBackend",
    "SlurmVersion",
    "SubprocessRunner",
    "compress",
    "default_timeout",
    "expand",
    "parse_job_id",
    "parse_scontrol_job",
    "parse_scontrol_nodes",
    "parse_sinfo_json",
    "parse_squeue_json",
    "parse_version",
    "pyslurm_matches",
    "select_backend",
    "StepRequest",
    "srun_argv",
    "step_env",
]
