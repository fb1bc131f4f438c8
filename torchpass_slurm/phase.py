"""What a rank is doing, as its heartbeat says: the heartbeat's ``state``.

The supervisor's hang detector (``supervisor/detect.py``, "no progress")
reads it: when the job's step has not advanced for its hang threshold, the
ranks behind are the ones to blame. A rank inside the elastic loop reports
where it is in the step::

    step S committed ─► COMPUTE ──the model's forward returned──► SYNC ──optimizer step──► S+1
                                                                     (backward: DDP's all-reduce)
    S+1 committed ─► HOOK (on_commit: logging, checkpoints) ─► COMPUTE ...
    a collective failed ─► RECOVERING ─► (the new epoch's first step) COMPUTE ...

A rank stuck in COMPUTE while a peer of the same step waits in SYNC is
the one not arriving at the collective. While any rank is in HOOK or
RECOVERING the job is not judged by progress: a checkpoint write may take
long, and a recovery has its own timeout. A rank outside the elastic loop
reports RUNNING.
"""

from __future__ import annotations

from torchpass_slurm.strenum import StrEnum

__all__ = ["Phase", "JUDGED"]


class Phase(StrEnum):
    """A rank's heartbeat ``state``."""

    STARTING = "starting"
    STANDBY = "standby"
    #: outside the elastic loop (a plain rank, or before ``fit``)
    RUNNING = "running"
    #: in the step, before the model's forward returned (data loading, forward)
    COMPUTE = "compute"
    #: the forward returned: backward, DDP's all-reduce, the optimizer step
    SYNC = "sync"
    #: in ``on_commit`` after a committed step (logging, checkpoints): may be slow
    HOOK = "hook"
    #: in the recovery path: waiting for the new epoch, rebuilding, agreeing, transferring
    RECOVERING = "recovering"
    DONE = "done"


#: The phases in which a rank's lack of progress is judged; a rank in any other phase (a slow
#: step is expected there, or it is not in the loop) stops the verdict.
JUDGED = frozenset({Phase.COMPUTE, Phase.SYNC})
