"""What a rank is doing, as its heartbeat says: the heartbeat's ``state``.

The supervisor's hang detector (``supervisor/detect.py``, "no progress")
reads it: when the job's step has not advanced for its hang threshold, the
ranks behind are the ones to blame. A rank inside the elastic loop reports
where it is in the step::

    step S committed ─► COMPUTE ──the DDP model's forward is called──► SYNC ──optimizer step──► S+1
                                    (DDP may broadcast buffers in it; backward all-reduces)
    S+1 committed ─► HOOK (on_commit: logging, checkpoints) ─► COMPUTE ...
    a collective failed ─► RECOVERING ─► (the new epoch's first step) COMPUTE ...

A rank stuck in COMPUTE while a peer of the same step waits in SYNC is
the one not arriving at the collectives. SYNC starts where DDP's first
collective may (the forward broadcasts buffers when the model has any), so a
peer blocked there is waiting, not behind. While any rank is in HOOK or
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
    #: in the step, before the DDP model's forward was called (data loading, preprocessing)
    COMPUTE = "compute"
    #: in the DDP model's forward (its buffer broadcast), backward (the all-reduce), the optimizer step
    SYNC = "sync"
    #: in ``on_commit`` after a committed step (logging, checkpoints): may be slow
    HOOK = "hook"
    #: in the recovery path: waiting for the new epoch, rebuilding, agreeing, transferring
    RECOVERING = "recovering"
    DONE = "done"


#: The phases in which a rank's lack of progress is judged; a rank in any other phase (a slow
#: step is expected there, or it is not in the loop) stops the verdict.
JUDGED = frozenset({Phase.COMPUTE, Phase.SYNC})
