"""The supervisor's state: what the loop, the detectors and the executor share.

:class:`JobState` is the one mutable record of a running job (membership,
steps, run state, the recovery in flight, the nodes leaving the job). Every
part of the supervisor reads it; only its own methods write it, each named
after the event that changes it (a recovery began, the ranks agreed, a node
was released...), and a test holds that no other module assigns one of its
fields or a field of its :class:`Migration`. Its run state changes only
through :meth:`JobState.enter`, along :data:`RUN_STATE_MACHINE`. The parts
that decide (the planner, the detectors) and carry out (the executor, the
orders, the allocation, the completion) call these methods; a step's own
state (:class:`~.workers.WorkerStep`) is written in :mod:`.workers` only.
"""

from __future__ import annotations

from collections.abc import Sequence
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

    # -- the writers: one per event that changes the job's record ------------------------
    def change_membership(self, new: Membership) -> None:
        """A new epoch's membership (a recovery, a spare added or lost)."""
        self.membership = new

    def launched(self, node: str, step: WorkerStep) -> None:
        """``node``'s step of this epoch started (it replaces the node's previous one)."""
        self.steps[node] = step

    def recovery_began(self, migration: Migration) -> None:
        """A planned migration is in flight."""
        self.migration = migration

    def recovery_chained(
        self,
        epoch: int,
        now: float,
        committed: int | None,
        failed: Sequence[str],
        resolution: Resolution = Resolution.LIVE,
        *,
        receiving: Sequence[str] = (),
    ) -> None:
        """A recovery from lost nodes starts now. One that starts while another is in flight (a
        fault during a recovery, a live move that fell back to a restart, a restart before the
        ranks resumed) continues its chain: the first one's start, its committed high mark (the
        chain's lost and recomputed steps count from it, once) and every node lost since; it
        alone will be closed, with the chain's numbers. ``receiving``: the spares promoted live
        now; with the chain's earlier ones not lost since, they hold no replica until the chain
        is done."""
        prev = self.migration
        earlier = (
            () if prev is None else tuple(n for n in prev.receiving if n not in failed or n in receiving)
        )
        self.migration = Migration(
            epoch=epoch,
            started=now if prev is None else prev.started,
            committed=committed if prev is None or prev.committed is None else prev.committed,
            failed=tuple(failed)
            if prev is None
            else prev.failed + tuple(n for n in failed if n not in prev.failed),
            resolution=resolution,
            receiving=earlier + tuple(n for n in receiving if n not in earlier),
            epoch_started=now,
        )

    def recovery_agreed(self, epoch: object, committed_step: int) -> None:
        """Rank 0's agreement of ``epoch``: the committed step every rank of it now holds."""
        if self.migration is not None and epoch == self.migration.epoch:
            self.migration.agreed = committed_step

    def leaving_ranks_left(self) -> None:
        """A planned migration's leaving ranks handed over and left: the switch came."""
        if self.migration is not None and self.migration.planned:
            self.migration.left = True

    def recovery_ended(self) -> None:
        self.migration = None

    def hold(self, holding: Holding | None) -> None:
        """The losses the job holds its step for (None: the hold ended)."""
        self.holding = holding

    def restarted(self, *, in_place: bool = False) -> int:
        """One more restart from a checkpoint (``in_place``: on the same nodes); the count."""
        if in_place:
            self.in_place_restarts += 1
            return self.in_place_restarts
        self.restarts += 1
        return self.restarts

    def moved_in_place(self, committed: int | None) -> None:
        """A live move in place at committed step ``committed`` (repeats at one step count up)."""
        self.in_place_moves = self.in_place_moves + 1 if self.in_place_at == committed else 1
        self.in_place_at = committed

    def releasing_node(self, node: str) -> None:
        """``node`` was drained: its ranks hand over, then it leaves the job."""
        self.releasing.add(node)

    def node_released(self, node: str) -> None:
        """``node``'s step ended: it goes back to Slurm."""
        self.releasing.discard(node)
        self.released.add(node)

    def nodes_unreleased(self, nodes: list[str]) -> None:
        """Slurm would not release ``nodes``: they are in the job's allocation still."""
        self.unreleased.update(nodes)

    def node_rejoined(self, node: str) -> None:
        """``node`` is the job's again (a refill merged it back)."""
        self.released.discard(node)
        self.unreleased.discard(node)

    def mesh_reported(self, mesh: MeshLayout) -> None:
        """The device mesh the ranks train on (the first one reported is the job's)."""
        self.layout = mesh

    def heard(self, until: float | None) -> None:
        """The control plane has been read up to ``until`` (unix time)."""
        self.heard_until = until

    def ended_with(self, exit_code: int, message: str) -> None:
        self.exit_code, self.message = exit_code, message

    # -- reading ------------------------------------------------------------------------
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
