"""The job supervisor (``tp run``): the monitor loop.

It runs in the batch step, on the batch host, and owns the job's control
plane. One ``srun --no-kill`` step per node runs the user's command: active
nodes hold the ranks, spare nodes run the same command in standby (imports
done, waiting in :func:`torchpass_slurm.rank.runtime.init`).

Each pass of the loop (every ``POLL_SLICE``) reads the control messages,
advances what waits on the workers, then detects, plans and acts::

    messages ──► JobState ◄── Executor.advance (promotions waiting for standby)
    Detectors.detect() ──faults──► plan_recovery(faults, membership, facts, policy) ──plan──►
    Executor.execute(plan)

Nothing in the loop blocks beyond one poll (or a bounded stop of steps): a
fault during a recovery is a new input to the planner. The decisions are all
in :func:`~torchpass_slurm.supervisor.plan.plan_recovery`.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from torchpass_slurm.config import NodeRole, SupervisorConfig, transport_from_env
from torchpass_slurm.control.bodies import Stop
from torchpass_slurm.control.kinds import Kind, ReportKind
from torchpass_slurm.control.messages import Message, body_of
from torchpass_slurm.control.rank_bodies import Heartbeat, Hello, RankStateCopy, Standby
from torchpass_slurm.control.reports import (
    Agreement,
    CollectiveFailed,
    FirstStep,
    HealthWarning,
    LiveReady,
    Released,
    Report,
    Resumed,
)
from torchpass_slurm.control.server import ControlServer
from torchpass_slurm.errors import ControlPlaneError
from torchpass_slurm.faults import Fault, RecoveryPolicy
from torchpass_slurm.rundir import events as ev
from torchpass_slurm.rundir.status import write_status
from torchpass_slurm.slurm import SlurmBackend
from torchpass_slurm.supervisor import hold
from torchpass_slurm.supervisor.completion import Completion
from torchpass_slurm.supervisor.context import JobContext
from torchpass_slurm.supervisor.detect import Detectors
from torchpass_slurm.supervisor.execute import Executor
from torchpass_slurm.supervisor.membership import Membership
from torchpass_slurm.supervisor.mesh import accept_mesh
from torchpass_slurm.supervisor.plan import Policy, WorkerFacts, plan_recovery
from torchpass_slurm.supervisor.probe import Probe
from torchpass_slurm.supervisor.refill import SparePool, waited_s
from torchpass_slurm.supervisor.state import Clock, JobState, RunResult, RunState
from torchpass_slurm.supervisor.status import job_status
from torchpass_slurm.supervisor.workers import StepLauncher, WorkerState, WorkerStep

__all__ = ["Supervisor", "RunState", "RunResult", "POLL_SLICE"]

logger = logging.getLogger(__name__)

#: How long one pass of the loop waits for control messages (bounds how late a
#: detection is judged: heartbeats arrive every 0.25 s, so passes are rarely that long).
POLL_SLICE = timedelta(seconds=0.1)
#: Messages that do not end a pass early (``Supervisor._pump``): the routine traffic.
ROUTINE_KINDS = frozenset({Kind.HEARTBEAT, Kind.RANK_STATE})
#: The shortest poll worth making for the rest of a pass (seconds; a timedelta holds microseconds).
MIN_POLL_S = 0.001
#: How often status.json is rewritten (seconds).
STATUS_INTERVAL_S = 1.0
#: Reports that go to the event log as they are.
RANK_EVENTS = frozenset(
    {
        ReportKind.GROUP_REBUILT,
        ReportKind.AGREEMENT,
        ReportKind.TRANSFER_DONE,
        ReportKind.FIRST_STEP,
        ReportKind.RELEASED,
        ReportKind.RANK_STATE_MISSING,
    }
)


class Supervisor:
    """Supervises one job's steps until the training ends.

    The loop is a branch over :class:`RunState`::

        LAUNCHING ──every active step said hello──► RUNNING
        RUNNING ──every active step exited 0──► SUCCEEDED
        any ──faults──► plan_recovery ──► one of
            live, planned, regroup ──► RECOVERING ──the new epoch's first step──► RUNNING
            restart on spares, restart in place ──► LAUNCHING (the relaunched steps say hello)
            hold (no spare yet) ──► RECOVERING ──a spare joined, or spare_wait over──► plan_recovery
            drop a spare, drain (pre-emptive), defer ──► the same state
            give up ──► FAILED
        RUNNING ──a drain seen, no recovery in flight──► plan_recovery (planned)
        any ──the supervisor itself fails──► FAILED
    """

    def __init__(
        self,
        *,
        job_id: int,
        run_dir: Path,
        membership: Membership,
        launcher: StepLauncher,
        server: ControlServer,
        slurm: SlurmBackend,
        events: ev.EventLog,
        config: SupervisorConfig,
        store: tuple[str, int] = ("", 0),
        recovery: RecoveryPolicy | str = RecoveryPolicy.LIVE,
        clock: Clock = time,
        batch_host: str | None = None,
        probe: Probe | None = None,
        refill: bool = False,
    ) -> None:
        self.run_dir = run_dir
        self.launcher = launcher
        self.server = server
        self.events = events
        self.clock = clock
        self.recovery = RecoveryPolicy(recovery)
        #: what carries the state of a live migration (TORCHPASS_TRANSPORT), for status.json
        self.transport = transport_from_env()
        self.store = store
        self.batch_host = socket.gethostname() if batch_host is None else batch_host
        self.job = JobState(job_id=job_id, membership=membership)
        self.probe = probe
        ctx = JobContext(self.job, slurm=slurm, events=events, config=config, clock=clock, probe=probe)
        self.detectors = Detectors(ctx)
        self.executor = Executor(ctx, launcher=launcher, server=server, store=store)
        self.completion = Completion(ctx)
        #: asks Slurm for a node whenever a spare was used (``refill``: tp run's jobs do)
        self.pool = SparePool(ctx, target=len(membership.spares) if refill else 0)
        #: what must live as long as the supervisor (the rendezvous store), closed after it
        self.keepalive: Any = None
        self._next_status = 0.0

    # the job's state, for callers and tests
    @property
    def membership(self) -> Membership:
        return self.job.membership

    @property
    def steps(self) -> dict[str, WorkerStep]:
        return self.job.steps

    @property
    def state(self) -> RunState:
        return self.job.state

    # -- the loop ----------------------------------------------------------------
    def run(self) -> RunResult:
        job, m = self.job, self.job.membership
        self.events.epoch = m.epoch
        self.events.append(
            ev.STARTED,
            active=list(m.active),
            spares=list(m.spares),
            world_size=m.world_size,
            ntasks_per_node=m.ntasks_per_node,
        )
        for node in m.active + m.spares:
            job.launched(node, self.launcher.launch(node, m))
        try:
            while not job.state.ended:
                self._pump(POLL_SLICE)
                self.executor.advance()
                self.launcher.enforce()
                self._reap()
                self.executor.allocation.collect()
                self.pool.check()
                for granted in self.pool.ready():
                    self.executor.add_spare(
                        granted.node,
                        waited_s(granted, self.clock),
                        returned=granted.returned,
                        in_job=granted.in_job,
                    )
                faults = self.detectors.detect()
                if faults or hold.due(job, self.clock):
                    self._recover([*hold.held_faults(job), *faults])
                elif self.detectors.settling:
                    pass  # judging a suspicion: nothing else starts meanwhile
                elif self.detectors.drains and job.migration is None and job.state == RunState.RUNNING:
                    self._recover([self.detectors.drains.pop(0)])
                elif self._training_completed():
                    self.completion.training_ended()
                    self.executor.finish(RunState.SUCCEEDED, 0, "training completed")
                self._write_status()
        except BaseException as err:
            if not job.state.ended:
                self.executor.finish(RunState.FAILED, 1, f"supervisor stopped: {err!r}")
            raise
        finally:
            self.pool.close()
            self.executor.allocation.close()
            self._write_status(force=True)
            if self.probe is not None:
                self.probe.close()
        return RunResult(job.exit_code, job.state, job.membership.epoch, job.restarts, job.message)

    def _recover(self, faults: list[Fault]) -> None:
        job = self.job
        workers = worker_facts(job, self.detectors.usable)
        policy = policy_of(job, self.recovery, bool(self.store[1]), self.batch_host, self.pool.hold_left())
        plan = plan_recovery(faults, job.membership, workers, policy)
        logger.info("plan: %s for %s", plan.action, ", ".join(f"{f.detector} on {f.node}" for f in faults))
        self.executor.execute(plan)
        if not job.state.ended:
            for node in plan.returned:
                self.pool.give_back(node)

    def _reap(self) -> None:
        """Steps that ended well: an active step's training finished, a drained node's step left."""
        for node, step in self.job.live_steps().items():
            rc = step.poll()
            if rc is None:
                continue
            if node in self.job.releasing:
                step.exited()
                self.executor.allocation.release(node)
            elif rc == 0 and step.role == NodeRole.ACTIVE:
                step.exited()
                self.events.append(ev.STEP_EXITED, node=node, exit_code=0)

    def _training_completed(self) -> bool:
        """Every active step exited 0. Spares promoted for a switch that no rank made are not
        training: with them, the drained node's step (the ranks they were to take) must have."""
        job, waiting = self.job, self.completion.unswitched()
        nodes = [n for n in job.membership.active if n not in waiting]
        if waiting and job.migration is not None:
            nodes += job.migration.failed
        return all(job.steps[n].state == WorkerState.EXITED and job.steps[n].exit_code == 0 for n in nodes)

    # -- messages ----------------------------------------------------------------
    def _pump(self, timeout: timedelta) -> None:
        self.job.heard(read_pass(self.server, self.clock, timeout, self._take))
        self._after_messages()

    def _take(self, peer: bytes, message: Message, now: float) -> None:
        node = message.sender.rsplit("/", 1)[0]
        step = self.job.steps.get(node)
        if step is None or step.state in (WorkerState.STOPPING, WorkerState.EXITED):
            return
        if step.state == WorkerState.LOST:
            self._fence(node, step, peer, message)
            return
        self._on_message(node, step, message, now)

    def _after_messages(self) -> None:
        self.job.progress.observe(
            self.clock.monotonic(), self.job.committed(list(self.job.membership.active))
        )
        if self.job.state == RunState.LAUNCHING and all(
            self.job.steps[n].state == WorkerState.RUNNING for n in self.job.membership.active
        ):
            self.job.enter(RunState.RUNNING)

    def _fence(self, node: str, step: WorkerStep, peer: bytes, message: Message) -> None:
        """A task of a step declared lost is still talking (a partition healed, a frozen process
        woke up): nothing it says counts. It is told to stop, once, and that is all the event
        log hears of it (``fenced``)."""
        if message.sender in step.fenced:
            return
        step.fenced.add(message.sender)
        self.events.append(ev.FENCED, node=node, sender=message.sender, message_kind=message.kind)
        logger.warning("fenced %s (its step on %s was declared lost): told to stop", message.sender, node)
        try:
            self.server.send(peer, Kind.STOP, Stop("fenced: this step was declared lost").to_body())
        except ControlPlaneError as err:
            logger.warning("cannot tell fenced %s to stop: %s", message.sender, err)

    def _on_message(self, node: str, step: WorkerStep, message: Message, now: float) -> None:
        kind, body = message.kind, message.body
        try:  # decode checked the body with the same class: this is its one typed reading
            if kind == Kind.HELLO:
                if step.hello(message.sender, body_of(message, Hello), now):  # the step is up
                    ranks = list(self.job.membership.ranks_of(node))
                    self.events.append(ev.WORKER_UP, node=node, role=step.role, ranks=ranks)
            elif kind == Kind.HEARTBEAT:
                step.heartbeat(message.sender, body_of(message, Heartbeat), now)
            elif kind == Kind.RANK_STATE:
                copy = body_of(message, RankStateCopy)
                self.job.rank_states.accept(self.job.membership, node, message.sender, copy)
            elif kind == Kind.BYE:
                step.said_bye.add(message.sender)  # it stops beating; its step's exit says the rest
            elif kind == Kind.STANDBY:
                if step.standby(message.sender, body_of(message, Standby), now):  # the spare is up
                    self.events.append(ev.WORKER_UP, node=node, role=NodeRole.SPARE)
            elif kind == Kind.REPORT:
                report = Report.from_body(body)
                if report.kind == ReportKind.COLLECTIVE_FAILED:  # alive, and tearing its group down
                    step.recovering(message.sender, now)
                else:
                    step.seen(message.sender, now)  # a rank that reports is alive
                self._on_report(node, step, report)
        except ControlPlaneError as err:  # a malformed body is logged and dropped, never fatal
            what = "report" if kind == Kind.REPORT else f"{kind} message"
            logger.warning("ignoring a malformed %s from %s: %s", what, message.sender, err)

    def _on_report(self, node: str, step: WorkerStep, report: Report) -> None:
        data = report.data
        if isinstance(data, LiveReady):
            if not accept_mesh(self.job, self.events, node, report):
                return  # refused whole: a rank whose mesh the planner cannot trust is not live
            step.live = True
        elif isinstance(data, CollectiveFailed):
            # only a failure in the job's current epoch is news; an older one is being recovered
            if data.epoch >= self.job.membership.epoch:
                self.detectors.collective_failed(node, data.rank, data.error or "")
        elif report.kind in RANK_EVENTS:
            self.events.append(ev.EventKind(report.kind), node=node, **report.fields)
            if isinstance(data, Agreement):
                self.completion.agreed(data.epoch, data.committed_step)
            elif isinstance(data, FirstStep):
                self.completion.first_step(data)
            elif isinstance(data, Released):
                self.executor.orders.released(data.rank)
                self.completion.released()
        elif isinstance(data, Resumed):
            self.completion.resumed(data)
        elif isinstance(data, HealthWarning) and (fault := self.detectors.health_warning(node, data)):
            self._recover([fault])  # pre-emptive: drained at a step boundary; move_now: lost now

    # -- status --------------------------------------------------------------------
    def _write_status(self, force: bool = False) -> None:
        now = self.clock.monotonic()
        if not force and now < self._next_status:
            return
        self._next_status = now + STATUS_INTERVAL_S
        try:
            write_status(self.run_dir, job_status(self.job, self.run_dir, self.clock.time(), self.transport))
        except OSError as err:
            logger.warning("could not write status.json: %s", err)


def policy_of(
    job: JobState, recovery: RecoveryPolicy, has_store: bool, batch_host: str, spare_wait: float
) -> Policy:
    """The planner's :class:`Policy` for ``job`` now: the standing choices, and its counters."""
    return Policy(
        recovery=recovery,
        has_store=has_store,
        batch_host=batch_host,
        in_place_restarts=job.in_place_restarts,
        layout=job.layout,
        spare_wait=spare_wait,
        receiving=job.migration.receiving if job.migration is not None else (),
        in_place_moves=job.moves_in_place(),
    )


def worker_facts(job: JobState, usable: Mapping[str, bool]) -> dict[str, WorkerFacts]:
    """What the planner needs of each step of ``job``; ``usable``: Slurm's last word per node."""
    return {
        n: WorkerFacts(live=s.live, running=s.state == WorkerState.RUNNING, usable=usable.get(n, False))
        for n, s in job.steps.items()
    }


def read_pass(
    server: ControlServer, clock: Clock, timeout: timedelta, take: Callable[[bytes, Message, float], None]
) -> float:
    """Read the control messages of one pass, each handed to ``take(peer, message, now)``; the
    time its last poll returned (everything sent before it has been read).

    Heartbeats and rank-state copies (the bulk: several a second per rank, spread in time) do
    not end the pass early: it takes them until ``timeout`` is spent, so detection runs at most
    once per ``timeout`` (it ran once per message burst, about 26 times a second with 5
    workers); any other message (a report, a hello, a standby) ends it at once, to be acted on.
    """
    deadline = clock.monotonic() + timeout.total_seconds()
    while True:
        urgent = False
        batch = server.poll(timeout)
        now = clock.time()  # when they were read: a message is never stamped earlier
        for peer, message in batch:
            urgent = urgent or message.kind not in ROUTINE_KINDS
            take(peer, message, now)
        left = deadline - clock.monotonic()
        if urgent or left < MIN_POLL_S:
            return now
        timeout = timedelta(seconds=left)
