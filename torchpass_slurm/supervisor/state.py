"""The supervisor's state: what the loop, the detectors and the executor share.

:class:`JobState` is the one mutable record of a running job (membership,
steps, run state, the recovery in flight); the loop (:mod:`.loop`) owns it,
the executor (:mod:`.execute`) changes it, the detectors (:mod:`.detect`)
read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchpass_slurm.faults import Fault, Resolution
from torchpass_slurm.mesh import MeshLayout
from torchpass_slurm.strenum import StrEnum
from torchpass_slurm.supervisor.membership import Membership
from torchpass_slurm.supervisor.progress import Progress
from torchpass_slurm.supervisor.rankstates import RankStates
from torchpass_slurm.supervisor.workers import Clock, WorkerState, WorkerStep

__all__ = ["Clock", "RunState", "RunResult", "Migration", "Holding", "JobState"]


class RunState(StrEnum):
    """The job as the supervisor runs it; :class:`~.loop.Supervisor`'s docstring draws the machine."""

    LAUNCHING = "launching"
    RUNNING = "running"
    RECOVERING = "recovering"
    SUCCEEDED = "succeeded"
    FAILED = "failed"

    @property
    def ended(self) -> bool:
        return self in (RunState.SUCCEEDED, RunState.FAILED)


@dataclass(frozen=True)
class RunResult:
    exit_code: int
    state: RunState
    epoch: int
    restarts: int
    message: str


@dataclass
class Migration:
    """A recovery in flight, until its first step (live, regroup) or its resume (checkpoint)."""

    epoch: int
    started: float
    committed: int | None  # the highest step survivors had reported before the fault
    failed: tuple[str, ...]
    resolution: Resolution = Resolution.LIVE
    #: a planned migration (drain): it switches at a step boundary, nothing is recomputed
    planned: bool = False
    #: the committed step the ranks agreed on (their agreement report)
    agreed: int | None = None
    #: a planned migration's spares, promoted before the switch step
    promoted: tuple[str, ...] = ()
    #: spares promoted live in the chain: no replica of anything until the recovery is done
    receiving: tuple[str, ...] = ()
    #: when the chain's latest recovery started (unix time; None: at ``started``), what a
    #: stalled recovery is measured from
    epoch_started: float | None = None
    #: a planned migration's leaving ranks have reported ``released``: the switch came
    left: bool = False


@dataclass(frozen=True)
class Holding:
    """The losses the job holds for (``supervisor/hold.py``), since when (unix time) and until
    when (monotonic)."""

    faults: tuple[Fault, ...]
    since: float
    until: float
    #: the wait it was given (seconds): it ends at ``since + wait_s`` in unix time
    wait_s: float = 0.0

    @property
    def nodes(self) -> list[str]:
        return [f.node for f in self.faults]

    def widened(self, faults: tuple[Fault, ...]) -> Holding:
        """The same wait, now for ``faults`` too (a loss during the hold)."""
        more = tuple(f for f in faults if f not in self.faults)
        return Holding(self.faults + more, self.since, self.until, self.wait_s)


@dataclass
class JobState:
    """One job's membership, steps and progress, as the supervisor knows them."""

    job_id: int
    membership: Membership
    steps: dict[str, WorkerStep] = field(default_factory=dict)
    state: RunState = RunState.LAUNCHING
    migration: Migration | None = None
    #: losses the job holds its committed step for, waiting for a spare (supervisor/hold.py)
    holding: Holding | None = None
    restarts: int = 0
    in_place_restarts: int = 0
    #: live moves in place (``supervisor/plan.py``) made at committed step ``in_place_at``
    in_place_moves: int = 0
    in_place_at: int | None = None
    #: drained nodes whose ranks are handing over, and those that have left the job
    releasing: set[str] = field(default_factory=set)
    released: set[str] = field(default_factory=set)
    #: lost nodes Slurm would not release: still in the job's allocation
    unreleased: set[str] = field(default_factory=set)
    exit_code: int = 1
    message: str = ""
    #: the training's pace, from the highest step heartbeats carry
    progress: Progress = field(default_factory=Progress)
    #: the device mesh the ranks reported (None: none did, the job is DDP over the world)
    layout: MeshLayout | None = None
    #: the last copies of each logical rank's own state, for the spare that takes it
    rank_states: RankStates = field(default_factory=RankStates)
    #: unix time up to which the control plane has been read (the end of the last read pass;
    #: None before the first). Silence is measured to here, not to the clock: a loop that was
    #: busy since (a node release held in scontrol for seconds) has not heard what came meanwhile.
    heard_until: float | None = None

    def silence_clock(self, now: float) -> float:
        """The time silence is measured to: ``now``, or the end of the last read pass if earlier."""
        return now if self.heard_until is None else min(now, self.heard_until)

    def moves_in_place(self) -> int:
        """Live moves in place since the job's committed step last moved (a crash that repeats
        at one step is a bug: they are bounded)."""
        return self.in_place_moves if self.committed(list(self.membership.active)) == self.in_place_at else 0

    def live_steps(self) -> dict[str, WorkerStep]:
        """Steps still worth watching: not stopped, not ended, not lost."""
        return {
            n: s
            for n, s in self.steps.items()
            if s.state not in (WorkerState.STOPPING, WorkerState.EXITED, WorkerState.LOST)
        }

    def committed(self, nodes: list[str]) -> int | None:
        """The highest step these nodes reported (from heartbeats; may lag by one beat)."""
        return max((self.steps[n].last_step or 0) for n in nodes) if nodes else None

    def last_heartbeat(self, nodes: list[str]) -> float | None:
        """When these nodes were last heard from: the start of the detection phase."""
        return max(((self.steps[n].last_heartbeat or 0.0) for n in nodes), default=0.0) or None
