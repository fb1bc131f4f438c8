"""The fault and recovery vocabulary: one set of names for the supervisor, the event log and the report.

A :class:`Fault` is what a detector saw (``detector``) on one node. Its
:class:`FaultClass` says how it came::

    detector            class         seen by
    step_exited         unplanned     the node's srun step ended with an error
    heartbeat_lost      unplanned     its ranks went silent past the heartbeat timeout
    rank_hung           unplanned     a rank heartbeats but makes no step progress while its peers wait
    startup_timeout     unplanned     a started step never said hello
    node_down           unplanned     Slurm reports the node DOWN / FAIL / NOT_RESPONDING
    node_gone           unplanned     Slurm no longer lists the node in the job
    collective_failed   unplanned     a rank's collective failed (the culprit is found by settling)
    recovery_stalled    unplanned     a recovery did not reach its first step within recovery_timeout
    gpu_failed          unplanned     the node's health agent saw a GPU signal that takes the node now
                                      (``health/gpu_signals.py``: move now, e.g. XID 79, NVML's
                                      recovery action "reset GPU")
    health_warning      pre-emptive   the node's in-job health agent saw WARNING / CRITICAL
    drain               planned       an admin drained the node (``scontrol``, ``tp drain``)

A :class:`Recovery` names what the supervisor did about it; its value is the
``mode`` of the ``migration_started`` event. A :class:`Resolution` names how
a fault ended; its value is the ``resolution`` of ``migration_done`` (live,
regroup, checkpoint) or what the report concludes (deferred, fatal). The
``--recovery`` option of ``tp run`` is a :class:`RecoveryPolicy`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchpass_slurm.strenum import StrEnum

__all__ = [
    "Detector",
    "FaultClass",
    "Fault",
    "Evidence",
    "Recovery",
    "Resolution",
    "RecoveryPolicy",
    "NODE_LOSS",
    "NODE_UNTRUSTED",
    "DRAIN_REASON_PREFIX",
    "MAX_DRAIN_REASON",
    "drain_reason_text",
    "pre_emptive_drain_reason",
    "is_pre_emptive_drain",
]


class Detector(StrEnum):
    """Which detector saw a fault first."""

    STEP_EXITED = "step_exited"
    HEARTBEAT_LOST = "heartbeat_lost"
    RANK_HUNG = "rank_hung"
    STARTUP_TIMEOUT = "startup_timeout"
    NODE_DOWN = "node_down"
    NODE_GONE = "node_gone"
    COLLECTIVE_FAILED = "collective_failed"
    RECOVERY_STALLED = "recovery_stalled"
    GPU_FAILED = "gpu_failed"
    HEALTH_WARNING = "health_warning"
    DRAIN = "drain"


class FaultClass(StrEnum):
    """How a fault came: it struck, it was foreseen, or it was asked for."""

    UNPLANNED = "unplanned"
    PRE_EMPTIVE = "pre-emptive"
    PLANNED = "planned"


#: Detectors whose fault means the node's step is lost (its ranks must move).
NODE_LOSS = frozenset(
    {
        Detector.STEP_EXITED,
        Detector.HEARTBEAT_LOST,
        Detector.RANK_HUNG,
        Detector.STARTUP_TIMEOUT,
        Detector.NODE_DOWN,
        Detector.NODE_GONE,
        Detector.GPU_FAILED,
    }
)
#: Detectors after which the node itself is not to be trusted: it is taken out of the job.
NODE_UNTRUSTED = frozenset(
    {Detector.HEARTBEAT_LOST, Detector.RANK_HUNG, Detector.NODE_DOWN, Detector.GPU_FAILED}
)


class Evidence(StrEnum):
    """Why a detector was sure enough to blame a node (the fault event's ``evidence``)."""

    #: the node's own step exited with an error while every other rank runs the elastic loop
    #: (they never exit for a peer's death): its process died, nothing to judge
    CONCLUSIVE = "conclusive"
    #: silent past ``silence_threshold``, and a peer's failed collective named its address
    PEER_REPORT = "peer-report"
    #: silent past ``silence_threshold``, and its slurmd did not accept a TCP connection
    PROBE = "probe"
    #: a rank silent past ``silence_threshold`` whose process its node's local rank 0 found
    #: gone (per-node heartbeats): the node beats, the rank is dead
    LOCAL_REPORT = "local-report"
    #: the settle window ended: the silent node, else the step that exited
    SETTLED = "settled"
    #: silent past ``heartbeat_timeout`` with nothing else to confirm it (a hung or frozen
    #: process), or a step never up within ``startup_timeout``
    TIMEOUT = "timeout"
    #: the job made no step progress for its hang threshold (a multiple of the median step
    #: time, with a floor), and this node's ranks are the ones behind: silent, or still
    #: computing a step their peers wait in
    PROGRESS = "progress"
    #: Slurm said so (node state, job node list)
    SLURM = "slurm"
    #: the node's own health agent saw a GPU fault that takes the node (a move-now signal)
    HEALTH = "health"


@dataclass(frozen=True)
class Fault:
    """A typed fault: what ``detector`` saw on ``node``, in words (``detail``), and why it is
    believed (``evidence``, empty for faults that are not judged: warnings, drains)."""

    node: str
    detector: Detector
    detail: str
    exit_code: int | None = None
    evidence: Evidence | None = None

    @property
    def fault_class(self) -> FaultClass:
        if self.detector == Detector.DRAIN:
            return FaultClass.PLANNED
        if self.detector == Detector.HEALTH_WARNING:
            return FaultClass.PRE_EMPTIVE
        return FaultClass.UNPLANNED

    @property
    def loses_node(self) -> bool:
        """The node's step is lost (as opposed to a warning, a drain or a failed collective)."""
        return self.detector in NODE_LOSS


class Recovery(StrEnum):
    """What the supervisor does about faults (``migration_started``'s ``mode``)."""

    #: a spare takes each lost slot; survivors rebuild their group in place; a replica sends the state
    LIVE = "live"
    #: a drained node's ranks hand over to a spare at a step boundary; the node leaves the job
    PLANNED = "planned"
    #: spares take the lost slots; every other step is relaunched; all resume from the checkpoint
    RESTART = "restart"
    #: no spare left but the nodes are usable: every step relaunched in place from the checkpoint
    RESTART_IN_PLACE = "restart-in-place"
    #: a collective failed and nobody is lost: the same ranks rebuild their group
    REGROUP = "regroup"


class Resolution(StrEnum):
    """How a fault ended, as the event log and the report name it."""

    LIVE = "live"
    REGROUP = "regroup"
    CHECKPOINT = "checkpoint"
    DEFERRED = "deferred"
    FATAL = "fatal"


class RecoveryPolicy(StrEnum):
    """``tp run --recovery``: live migration where it can, or always a checkpoint restart."""

    LIVE = "live"
    RESTART = "restart"


# --- drain reasons: written by health/drain.py and the planner, read by the report -----------

#: Every reason torchpass drains a node with starts with this; nothing else is ever undrained
#: (``health/drain.py``).
DRAIN_REASON_PREFIX = "torchpass:"
#: Slurm keeps long reasons, but sinfo shows few characters: a reason is cut to this many.
MAX_DRAIN_REASON = 120


def drain_reason_text(what: str) -> str:
    """The one builder of a torchpass drain reason: ``torchpass: WHAT`` on one line, cut to
    :data:`MAX_DRAIN_REASON` characters (ending in ``...`` when cut)."""
    text = " ".join(f"{DRAIN_REASON_PREFIX} {what}".split())
    return text if len(text) <= MAX_DRAIN_REASON else text[: MAX_DRAIN_REASON - 3] + "..."


def pre_emptive_drain_reason(detail: str) -> str:
    """The reason the job drains a node with on a health warning (``torchpass: pre-emptive: ...``)."""
    return drain_reason_text(f"{FaultClass.PRE_EMPTIVE.value}: {detail}")


def is_pre_emptive_drain(reason: str | None) -> bool:
    """Whether ``reason`` is one :func:`pre_emptive_drain_reason` wrote."""
    lead = f"{DRAIN_REASON_PREFIX} {FaultClass.PRE_EMPTIVE.value}:"
    return reason is not None and " ".join(reason.split()).startswith(lead)
