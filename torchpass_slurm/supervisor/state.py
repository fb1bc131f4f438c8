"""The supervisor's state: what the loop, the detectors and the executor share.

:class:`JobState` is the one mutable record of a running job (membership,
steps, run state, the recovery in flight); the loop (:mod:`.loop`) owns it,
the executor (:mod:`.execute`) changes it, the detectors (:mod:`.detect`)
read it. Its run state changes only through :meth:`JobState.enter`, along
:data:`RUN_STATE_MACHINE`.
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

__all__ = ["Clock", "RunState", "RUN_STATE_MACHINE", "RunResult", "Migration", "Holding", "JobState"]


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


#: The job's run-state machine: every transition :meth:`JobState.enter` allows, and what
#: makes it. ``RECOVERING -> RECOVERING`` is a recovery that starts while one is in flight
#: (it continues the chain); an ended job never moves again::
#:
#:     LAUNCHING ──every active step said hello──► RUNNING
#:     LAUNCHING, RUNNING, RECOVERING ──a recovery starts──► RECOVERING
#:     RECOVERING ──the new epoch's first step──► RUNNING
#:     RECOVERING ──a restart relaunches the steps──► LAUNCHING
#:     LAUNCHING, RUNNING, RECOVERING ──every active step exited 0──► SUCCEEDED
#:     LAUNCHING, RUNNING, RECOVERING ──give up, or the supervisor itself fails──► FAILED
_LIVE = (RunState.LAUNCHING, RunState.RUNNING, RunState.RECOVERING)
RUN_STATE_MACHINE: dict[tuple[RunState, RunState], str] = {
    (RunState.LAUNCHING, RunState.RUNNING): "every active step said hello",
    **{(s, RunState.RECOVERING): "a recovery starts" for s in _LIVE},
    (RunState.RECOVERING, RunState.RUNNING): "the new epoch's first step",
    (RunState.RECOVERING, RunState.LAUNCHING): "a restart relaunches the steps",
    **{(s, RunState.SUCCEEDED): "every active step exited 0" for s in _LIVE},
    **{(s, RunState.FAILED): "give up, or the supervisor itself fails" for s in _LIVE},
}


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

    def enter(self, state: RunState) -> None:
        """Move the job to ``state``: the one way its run state changes. A transition that
        :data:`RUN_STATE_MACHINE` does not hold is a bug in the supervisor: an error. Staying
        in a live state is no transition (a second hello round, a repeated first step)."""
        if state == self.state and not state.ended and state != RunState.RECOVERING:
            return
        if (self.state, state) not in RUN_STATE_MACHINE:
            raise RuntimeError(f"job {self.job_id}: no transition from {self.state} to {state}")
        self.state = state

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
