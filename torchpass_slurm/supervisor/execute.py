"""The executor: carries out a recovery :class:`~.plan.Plan`, one action at a time, never waiting.

Each plan becomes events, launches, stops and control messages at once; what
must wait for the workers is left as state with a deadline that the loop
advances on every pass:

- a promotion waits for the spare's standby (every task of its step), at most
  ``startup_timeout``; meanwhile messages and detectors go on, and a fault of
  the spare is a new input to the planner;
- a live, planned or regroup recovery is a :class:`~.state.Migration` until
  rank 0 reports the new epoch's first step; a checkpoint restart one until
  rank 0 reports that it resumed.

:meth:`Executor.change_membership` is the one routine that moves the job to a
new membership (and epoch).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torchpass_slurm import events as ev
from torchpass_slurm.config import SupervisorConfig
from torchpass_slurm.control.bodies import Promote, PromoteMode, Reconfigure, Stop
from torchpass_slurm.control.messages import Kind
from torchpass_slurm.control.server import ControlServer
from torchpass_slurm.errors import ControlPlaneError, SlurmError
from torchpass_slurm.faults import Detector, Fault, Resolution
from torchpass_slurm.slurm import SlurmBackend
from torchpass_slurm.supervisor.membership import Membership
from torchpass_slurm.supervisor.plan import Action, Plan
from torchpass_slurm.supervisor.state import Clock, JobState, Migration, RunState
from torchpass_slurm.supervisor.workers import StepLauncher, WorkerState, master_port

__all__ = ["Executor"]

logger = logging.getLogger(__name__)

#: The event each losing detector is recorded as.
_LOSS_EVENT = {Detector.HEARTBEAT_LOST: ev.HEARTBEAT_LOST, Detector.STARTUP_TIMEOUT: ev.HEARTBEAT_LOST,
               Detector.NODE_DOWN: ev.NODE_DOWN, Detector.NODE_GONE: ev.NODE_DOWN,
               Detector.STEP_EXITED: ev.STEP_EXITED}


@dataclass(frozen=True)
class _Promotion:
    """A spare to promote once every task of its step is on standby, or at ``deadline``."""

    mode: PromoteMode
    deadline: float


class Executor:
    """Carries out plans on one job; see the module docstring."""

    def __init__(self, job: JobState, *, launcher: StepLauncher, server: ControlServer,
                 slurm: SlurmBackend, events: ev.EventLog, config: SupervisorConfig,
                 clock: Clock, store: tuple[str, int]) -> None:
        self.job = job
        self.launcher = launcher
        self.server = server
        self.slurm = slurm
        self.events = events
        self.config = config
        self.clock = clock
        self.store_addr, self.store_port = store
        self._promotions: dict[str, _Promotion] = {}
        self._actions = {
            Action.LIVE: self._live, Action.PLANNED: self._planned, Action.RESTART: self._restart,
            Action.RESTART_IN_PLACE: self._restart_in_place, Action.REGROUP: self._regroup,
            Action.DROP_SPARE: self._drop_spare, Action.DRAIN: self._drain,
            Action.DEFER: self._defer, Action.GIVE_UP: self._give_up,
            Action.NOTHING: self._nothing}

    # -- the one routine that changes the epoch ----------------------------------
    def change_membership(self, new: Membership) -> None:
        self.job.membership = new
        self.events.epoch = new.epoch

    # -- plans ------------------------------------------------------------------
    def execute(self, plan: Plan) -> None:
        """Carry out ``plan``: record and stop what was lost, act, then release dead nodes."""
        for fault in plan.faults:
            if fault.loses_node:
                self._record(fault)
        if plan.stop:
            self.launcher.stop([self.job.steps[n] for n in plan.stop], self.config.lost_stop_timeout)
            for node in plan.stop:
                self._promotions.pop(node, None)
        self._drop_spares(plan)
        self._actions[plan.action](plan)
        if plan.release and not self.job.state.ended:
            self.shrink_out(list(plan.release), reason="lost")  # after the recovery started

    def _nothing(self, plan: Plan) -> None:
        pass

    def _drop_spare(self, plan: Plan) -> None:
        self.change_membership(plan.membership)

    def _give_up(self, plan: Plan) -> None:
        self.job.state = RunState.RECOVERING
        self.finish(RunState.FAILED, plan.exit_code, plan.detail)

    def _defer(self, plan: Plan) -> None:
        (fault,) = plan.faults
        self.events.append(ev.DRAIN_DEFERRED, node=fault.node, reason=fault.detail, detail=plan.detail)

    def _drain(self, plan: Plan) -> None:
        node = plan.faults[0].node
        try:
            self.slurm.drain(node, plan.detail)
        except SlurmError as err:  # without the drain the node keeps its ranks
            logger.warning("could not drain %s after its health warning: %s", node, err)

    def _live(self, plan: Plan) -> None:
        new, failed = plan.membership, [f.node for f in plan.lost]
        survivors = [n for n in new.active if n not in plan.promoted]
        committed = self.job.committed(survivors)
        self.change_membership(new)
        self.events.append(ev.MIGRATION_STARTED, failed=failed, spares=list(plan.promoted),
                           last_heartbeat=self.job.last_heartbeat(failed),
                           committed_step=committed, mode=plan.action.recovery)
        for spare, node in zip(plan.promoted, failed, strict=True):
            self.events.append(ev.SPARE_PROMOTED, node=spare, replaces=node,
                               ranks=list(new.ranks_of(spare)), mode=PromoteMode.LIVE)
        prev = self.job.migration  # a fault during a migration: one recovery covers both
        self.job.migration = Migration(
            epoch=new.epoch, started=prev.started if prev else self.clock.time(),
            committed=prev.committed if prev and prev.committed is not None else committed,
            failed=(prev.failed if prev else ()) + tuple(failed))
        self.reconfigure(survivors)
        for spare in plan.promoted:
            self.promote(spare, PromoteMode.LIVE)
        self.job.state = RunState.RECOVERING

    def _planned(self, plan: Plan) -> None:
        (fault,), (spare,) = plan.lost, plan.promoted
        old, new = self.job.membership, plan.membership
        committed = self.job.committed(list(old.active))
        self.change_membership(new)
        self.events.append(ev.MIGRATION_STARTED, failed=[fault.node], spares=[spare],
                           mode=plan.action.recovery, reason=fault.detail, last_heartbeat=None,
                           committed_step=committed)
        self.events.append(ev.SPARE_PROMOTED, node=spare, replaces=fault.node, mode=PromoteMode.LIVE,
                           ranks=list(new.ranks_of(spare)))
        self.job.migration = Migration(epoch=new.epoch, started=self.clock.time(),
                                       committed=committed, failed=(fault.node,), planned=True)
        self.job.releasing.add(fault.node)
        self.reconfigure(list(old.active), leave=tuple(old.ranks_of(fault.node)))
        self.promote(spare, PromoteMode.LIVE)
        self.job.state = RunState.RECOVERING

    def _regroup(self, plan: Plan) -> None:
        self.change_membership(plan.membership)
        self.events.append(ev.MIGRATION_STARTED, failed=[], spares=[], last_heartbeat=None,
                           committed_step=None, detail=plan.detail, mode=plan.action.recovery)
        self.job.migration = Migration(epoch=plan.membership.epoch, started=self.clock.time(),
                                       committed=None, failed=(), resolution=Resolution.REGROUP)
        self.reconfigure(list(plan.membership.active))
        self.job.state = RunState.RECOVERING

    def _restart(self, plan: Plan) -> None:
        self.job.state = RunState.RECOVERING
        new, failed = plan.membership, [f.node for f in plan.lost]
        for spare, node in zip(plan.promoted, failed, strict=True):
            self.events.append(ev.SPARE_PROMOTED, epoch=new.epoch, node=spare, replaces=node,
                               ranks=list(new.ranks_of(spare)))
        self.change_membership(new)
        survivors = [n for n in new.active if n not in plan.promoted]
        committed = self.job.committed(survivors)
        self.events.append(ev.MIGRATION_STARTED, failed=failed, spares=list(plan.promoted),
                           last_heartbeat=self.job.last_heartbeat(failed), committed_step=committed,
                           mode=plan.action.recovery)
        self._relaunch(survivors, plan, committed)

    def _restart_in_place(self, plan: Plan) -> None:
        self.job.state = RunState.RECOVERING
        self.job.in_place_restarts += 1
        failed = [f.node for f in plan.lost]
        committed = self.job.committed(list(self.job.membership.active))
        self.change_membership(plan.membership)
        self.events.append(ev.MIGRATION_STARTED, failed=failed, spares=[],
                           mode=plan.action.recovery, last_heartbeat=self.job.last_heartbeat(failed),
                           committed_step=committed)
        self._relaunch(list(plan.membership.active), plan, committed, in_place=True)

    def _relaunch(self, relaunch: list[str], plan: Plan, committed: int | None,
                  **restarted: Any) -> None:
        """Stop and relaunch ``relaunch`` in the new epoch, promote the spares; all resume."""
        new = self.job.membership
        self.launcher.stop([self.job.steps[n] for n in relaunch], self.config.stop_timeout)
        for node in relaunch:
            self.job.steps[node] = self.launcher.launch(node, new)
        for spare in plan.promoted:
            self.promote(spare, PromoteMode.RESTART)
        self.job.restarts += 1
        self.events.append(ev.RESTARTED, restarts=self.job.restarts, active=list(new.active),
                           spares=list(new.spares), from_checkpoint=True, **restarted)
        self.job.migration = Migration(epoch=new.epoch, started=self.clock.time(),
                                       committed=committed, failed=tuple(f.node for f in plan.lost),
                                       resolution=Resolution.CHECKPOINT)
        self.job.state = RunState.LAUNCHING

    def _drop_spares(self, plan: Plan) -> None:
        spares_left = len(plan.membership.spares) + len(plan.promoted)
        for node in plan.dropped:
            extra = {"reason": plan.detail} if plan.action == Action.DROP_SPARE and plan.detail else {}
            self.events.append(ev.SPARE_LOST, epoch=plan.membership.epoch, node=node,
                               spares_left=spares_left, **extra)
            if extra:  # a drained spare: its standby tasks leave, then its node is released
                for sender in self.job.steps[node].standby_senders:
                    self.send(sender, Kind.STOP, Stop(f"node {plan.detail}").to_body())
                self.job.releasing.add(node)

    def _record(self, fault: Fault) -> None:
        step = self.job.steps[fault.node]
        m = self.job.membership
        role = m.role_of(fault.node) if fault.node in m.active + m.spares else step.role
        step.state = WorkerState.LOST
        self.events.append(_LOSS_EVENT[fault.detector], node=fault.node, role=role,
                           detector=fault.detector, detail=fault.detail, exit_code=fault.exit_code)
        logger.warning("fault: %s", fault.detail)

    # -- waits with deadlines, advanced by the loop -------------------------------
    def promote(self, node: str, mode: PromoteMode) -> None:
        """Promote the spare once its step is on standby (now, if it already is)."""
        deadline = self.clock.monotonic() + self.config.startup_timeout
        self._promotions[node] = _Promotion(mode, deadline)
        self.advance()

    def advance(self) -> None:
        """Send the promotions whose spares are ready (or whose wait is over)."""
        now = self.clock.monotonic()
        for node, pending in list(self._promotions.items()):
            step = self.job.steps[node]
            if step.all_standby() or step.poll() is not None or now >= pending.deadline:
                del self._promotions[node]
                self._send_promote(node, pending.mode)

    def _send_promote(self, node: str, mode: PromoteMode) -> None:
        """Tell the spare's standby tasks their ranks; its step starts as an active one."""
        step, m = self.job.steps[node], self.job.membership
        step.role, step.epoch, step.state = "active", m.epoch, WorkerState.STARTING
        step.heartbeats.clear()
        step.hello_senders.clear()
        step.started = self.clock.time()
        for sender in sorted(step.standby_senders):
            local = int(sender.rsplit("/", 1)[1])
            body = Promote(rank=m.rank_base(node) + local, local_rank=local, world_size=m.world_size,
                           master_addr=m.node_of_rank(0), master_port=master_port(self.job.job_id, m.epoch),
                           epoch=m.epoch, mode=mode, store_addr=self.store_addr,
                           store_port=self.store_port)
            self.send(sender, Kind.PROMOTE, body.to_body())

    def reconfigure(self, nodes: list[str], *, leave: tuple[int, ...] | None = None) -> None:
        """Tell the ranks on ``nodes`` to rebuild their group for the current epoch."""
        m = self.job.membership
        body = Reconfigure(epoch=m.epoch, world_size=m.world_size, store_addr=self.store_addr,
                           store_port=self.store_port, planned=leave is not None,
                           leave=leave or ()).to_body()
        for node in nodes:
            step = self.job.steps[node]
            step.epoch = m.epoch
            for sender in sorted(step.hello_senders):
                self.send(sender, Kind.RECONFIGURE, body)

    # -- the ends of recoveries ----------------------------------------------------
    def agreed(self, epoch: object, committed_step: int) -> None:
        mig = self.job.migration
        if mig is not None and epoch == mig.epoch:
            mig.agreed = committed_step

    def first_step(self, fields: Mapping[str, Any]) -> None:
        """Rank 0 committed the new epoch's first step: a live recovery is done."""
        mig = self.job.migration
        if (mig is None or mig.resolution not in (Resolution.LIVE, Resolution.REGROUP)
                or fields.get("epoch", mig.epoch) != mig.epoch):
            return
        lost = (None if mig.committed is None or mig.agreed is None
                else max(0, mig.committed - mig.agreed))
        self.events.append(ev.MIGRATION_DONE, resolution=mig.resolution, lost_steps=lost,
                           recomputed_steps=0 if mig.planned else 1, planned=mig.planned,
                           failed=list(mig.failed), seconds=round(self.clock.time() - mig.started, 3))
        self.job.migration = None
        self.job.state = RunState.RUNNING

    def resumed(self, fields: Mapping[str, Any]) -> None:
        """Rank 0 resumed from the checkpoint after a restart: the steps since it are lost."""
        mig = self.job.migration
        if mig is None or mig.resolution != Resolution.CHECKPOINT or fields.get("epoch") != mig.epoch:
            return
        resumed = int(fields.get("step", 0))
        lost = None if mig.committed is None else max(0, mig.committed - resumed)
        self.events.append(ev.MIGRATION_DONE, resolution=Resolution.CHECKPOINT, lost_steps=lost,
                           recomputed_steps=lost, resumed_step=resumed, failed=list(mig.failed),
                           seconds=round(self.clock.time() - mig.started, 3))
        self.job.migration = None

    def release(self, node: str) -> None:
        """A drained node's step has ended: give the node back to Slurm (it becomes DRAINED)."""
        self.job.releasing.discard(node)
        self.job.released.add(node)
        self.shrink_out([node], reason="drained")

    def shrink_out(self, nodes: list[str], *, reason: str) -> None:
        """Shrink the job to its other nodes; a NODE_RELEASED event per node says how it went."""
        try:
            keep = [n for n in self.slurm.job(self.job.job_id).nodes if n not in nodes]
            if keep:
                self.slurm.shrink_job(self.job.job_id, keep)
        except SlurmError as err:  # the nodes leave when the job ends instead
            logger.warning("could not release %s from job %s: %s", ",".join(nodes), self.job.job_id, err)
            for node in nodes:
                self.events.append(ev.NODE_RELEASED, node=node, released=False, reason=reason,
                                   error=str(err))
            return
        for node in nodes:
            self.events.append(ev.NODE_RELEASED, node=node, released=True, reason=reason)

    def finish(self, state: RunState, exit_code: int, message: str) -> None:
        """End the job: spares leave, every step stops, the end is logged."""
        for node in self.job.membership.spares:
            step = self.job.steps.get(node)
            for sender in step.standby_senders if step is not None else ():
                self.send(sender, Kind.STOP, Stop(message).to_body())
        self.launcher.stop(self.job.steps.values(), self.config.stop_timeout)
        self.job.state, self.job.exit_code, self.job.message = state, exit_code, message
        kind = ev.FINISHED if state == RunState.SUCCEEDED else ev.FAILED
        self.events.append(kind, exit_code=exit_code, message=message, restarts=self.job.restarts)
        (logger.info if state == RunState.SUCCEEDED else logger.error)("%s (exit %d)", message, exit_code)

    def send(self, sender: str, kind: Kind, body: dict[str, Any]) -> None:
        """Best effort: a worker that is gone is found by the detectors, not here."""
        peer = self.server.peer_of(sender)
        if peer is None:
            logger.warning("cannot send %s to %s: never connected", kind, sender)
            return
        try:
            self.server.send(peer, kind, body)
        except ControlPlaneError as err:
            logger.warning("cannot send %s to %s: %s", kind, sender, err)
