"""What every part of one job's supervisor works with: the job's state and the world around it.

The supervisor is built of parts (the detectors, the executor and the orders it
sends, the allocation, the completion, the spare pool); each is handed one
:class:`JobContext` rather than the same five collaborators one by one. The
context only carries them: the job's state has its owner in :mod:`.state`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchpass_slurm.config import SupervisorConfig
from torchpass_slurm.rundir import events as ev
from torchpass_slurm.slurm import SlurmBackend
from torchpass_slurm.supervisor.probe import Probe
from torchpass_slurm.supervisor.state import Clock, JobState

__all__ = ["JobContext"]


@dataclass(frozen=True)
class JobContext:
    """One job's state, Slurm, the event log, the settings, the clock and the node probe."""

    job: JobState
    slurm: SlurmBackend
    events: ev.EventLog
    config: SupervisorConfig
    clock: Clock
    #: asks a lost node's slurmd whether it is up (None: only Slurm's word and the wait)
    probe: Probe | None = None
