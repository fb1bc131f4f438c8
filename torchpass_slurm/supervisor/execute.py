"""The executor: carries out a recovery :class:`~.plan.Plan`, one action at a time, never waiting.

Each plan becomes events, launches, stops and control messages at once; what
must wait for the workers is left as state with a deadline that the loop
advances on every pass:

- a promotion waits for the spare's standby (every task of its step), at most
  ``startup_timeout`` (:class:`~.orders.Orders`); meanwhile messages and
  detectors go on, and a fault of the spare is a new input to the planner;
- a live, planned or regroup recovery is a :class:`~.state.Migration` until
  rank 0 reports the new epoch's first step; a checkpoint restart one until
  rank 0 reports that it resumed.

:meth:`Executor.change_membership` is the one routine that moves the job to a
new membership (and epoch).
"""

from __future__ import annotations

import logging
from typing import Any

from torchpass_slurm.config import NodeRole
from torchpass_slurm.control.bodies import PromoteMode
from torchpass_slurm.control.server import ControlServer
from torchpass_slurm.errors import SlurmError
from torchpass_slurm.faults import Detector, Fault, Resolution
from torchpass_slurm.rundir import events as ev
from torchpass_slurm.supervisor import hold
from torchpass_slurm.supervisor.allocation import Allocation
from torchpass_slurm.supervisor.context import JobContext
from torchpass_slurm.supervisor.membership import Membership
from torchpass_slurm.supervisor.orders import Orders
from torchpass_slurm.supervisor.plan import Action, Plan
from torchpass_slurm.supervisor.state import Holding, JobState, Migration, RunState
from torchpass_slurm.supervisor.workers import StepLauncher

__all__ = ["Executor"]

logger = logging.getLogger(__name__)

#: The event each losing detector is recorded as.
_LOSS_EVENT = {
    Detector.HEARTBEAT_LOST: ev.HEARTBEAT_LOST,
    Detector.RANK_HUNG: ev.RANK_HUNG,
    Detector.STARTUP_TIMEOUT: ev.HEARTBEAT_LOST,
    Detector.NODE_DOWN: ev.NODE_DOWN,
    Detector.NODE_GONE: ev.NODE_DOWN,
    Detector.STEP_EXITED: ev.STEP_EXITED,
    Detector.GPU_FAILED: ev.GPU_FAILED,
}


class Executor:
    """Carries out plans on one job; see the module docstring."""

    def __init__(
        self, ctx: JobContext, *, launcher: StepLauncher, server: ControlServer, store: tuple[str, int]
    ) -> None:
        self.ctx = ctx
        self.job = ctx.job
        self.launcher = launcher
        self.allocation = Allocation(ctx)
        self.orders = Orders(ctx, server=server, store=store)
        #: the hold the plan being carried out ends (its losses were recorded when it began)
        self._held: Holding | None = None
        self.in_place = InPlace(ctx.job, launcher, self.orders)
        self._actions = {
            Action.LIVE: self._live,
            Action.PLANNED: self._planned,
            Action.RESTART: self._restart,
            Action.RESTART_IN_PLACE: self._restart_in_place,
            Action.HOLD: self._hold,
            Action.REGROUP: self._regroup,
            Action.DROP_SPARE: self._drop_spare,
            Action.DRAIN: self._drain,
            Action.DEFER: self._defer,
            Action.GIVE_UP: self._give_up,
            Action.NOTHING: self._nothing,
        }

    # -- the one routine that changes the epoch ----------------------------------
    def change_membership(self, new: Membership) -> None:
        self.job.change_membership(new)
        self.ctx.events.epoch = new.epoch

    def add_spare(self, node: str, waited: float, *, returned: bool = False, in_job: bool = False) -> None:
        """A node joins the spare pool: its standby step starts. Slurm gave it to the job (a
        refill, ``waited`` s after it was asked for), or it is ``returned``: the job lost a rank
        on it, not the node (``waited`` s ago), or it is ``in_job``: lost, never released, and
        alive again."""
        new = self.job.membership.with_spare(node)
        self.change_membership(new)
        if not returned:
            if not in_job:
                self.launcher.expanded.add(node)
            self.allocation.rejoined(node)
        self.job.launched(node, self.launcher.launch(node, new))
        extra = {"in_job": True} if in_job else {}
        self.ctx.events.append(
            ev.SPARE_ADDED, node=node, seconds=waited, spares=list(new.spares), returned=returned, **extra
        )
        since = "its rank was lost" if returned else "it was asked for"
        logger.info("%s joined the spare pool, %.1f s after %s", node, waited, since)

    # -- plans ------------------------------------------------------------------
    def execute(self, plan: Plan) -> None:
        """Carry out ``plan``: record and stop what was lost, act, then release dead nodes.
        A plan after a hold (``supervisor/hold.py``) ends it; the held losses were recorded."""
        held = self.job.holding
        self._held = held if plan.action != Action.HOLD else None
        if self._held is not None:
            self.job.hold(None)
        for fault in plan.faults:
            if fault.loses_node and (held is None or fault not in held.faults):
                record_loss(self.job, self.ctx.events, fault)
        if plan.stop:
            self.launcher.stop_lost([self.job.steps[n] for n in plan.stop], self.ctx.config.lost_stop_timeout)
            for node in plan.stop:
                self.orders.cancel(node)
        self._drop_spares(plan)
        self._actions[plan.action](plan)
        if plan.release and not self.job.state.ended:
            self.allocation.shrink_out(list(plan.release), reason="lost")  # after the recovery started

    def _nothing(self, plan: Plan) -> None:
        pass

    def _hold(self, plan: Plan) -> None:
        """No spare for a loss whose state a replica holds: wait for the pool to refill."""
        self.change_membership(plan.membership)  # spares lost meanwhile leave the pool
        hold.begin(
            self.job, plan.lost, plan.detail, self.ctx.events, self.ctx.config.spare_wait, self.ctx.clock
        )

    def _drop_spare(self, plan: Plan) -> None:
        self.change_membership(plan.membership)

    def _give_up(self, plan: Plan) -> None:
        self.finish(RunState.FAILED, plan.exit_code, plan.detail)

    def _defer(self, plan: Plan) -> None:
        (fault,) = plan.faults
        self.ctx.events.append(ev.DRAIN_DEFERRED, node=fault.node, reason=fault.detail, detail=plan.detail)

    def _drain(self, plan: Plan) -> None:
        node = plan.faults[0].node
        try:
            self.ctx.slurm.drain(node, plan.detail)
        except SlurmError as err:  # without the drain the node keeps its ranks
            logger.warning("could not drain %s after its health warning: %s", node, err)

    def _live(self, plan: Plan) -> None:
        new, failed = plan.membership, plan.lost_nodes
        survivors = [n for n in new.active if n not in plan.promoted]
        committed = self.job.committed(survivors)
        self.change_membership(new)
        self._migration_started(plan, committed)
        for spare, node in zip(plan.promoted, failed, strict=True):
            self.ctx.events.append(
                ev.SPARE_PROMOTED,
                node=spare,
                replaces=node,
                ranks=list(new.ranks_of(spare)),
                mode=PromoteMode.LIVE,
                **({"in_place": True} if spare == node else {}),
            )
        self.job.recovery_chained(
            new.epoch, self.ctx.clock.time(), committed, failed, receiving=plan.promoted
        )
        self.orders.reconfigure(survivors)
        for spare, node in zip(plan.promoted, failed, strict=True):
            if spare == node:
                self.in_place.add(node, committed)
            else:
                self.orders.promote(spare, PromoteMode.LIVE)
        self.job.enter(RunState.RECOVERING)

    def advance(self) -> None:
        """Each loop pass: moves in place whose old step has ended get their standby, then the
        promotions whose spares are ready go out."""
        self.in_place.advance()
        self.orders.advance()

    def _planned(self, plan: Plan) -> None:
        (fault,), (spare,) = plan.lost, plan.promoted
        old, new = self.job.membership, plan.membership
        committed = self.job.committed(list(old.active))
        # every rank must hear of the switch before it commits that step
        switch_after = (committed or 0) + self.job.progress.steps_ahead(self.ctx.config.switch_lead)
        self.change_membership(new)
        self.ctx.events.append(
            ev.MIGRATION_STARTED,
            failed=[fault.node],
            spares=[spare],
            mode=plan.action.recovery,
            reason=fault.detail,
            last_heartbeat=None,
            committed_step=committed,
            switch_after=switch_after,
        )
        self.ctx.events.append(
            ev.SPARE_PROMOTED,
            node=spare,
            replaces=fault.node,
            mode=PromoteMode.LIVE,
            ranks=list(new.ranks_of(spare)),
        )
        self.job.recovery_began(
            Migration(
                epoch=new.epoch,
                started=self.ctx.clock.time(),
                committed=committed,
                failed=(fault.node,),
                planned=True,
                promoted=(spare,),
            )
        )
        self.job.releasing_node(fault.node)
        self.orders.reconfigure(
            list(old.active), leave=tuple(old.ranks_of(fault.node)), switch_after=switch_after
        )
        leaving = old.ranks_of(fault.node)  # with rank state, their copy of the switch step comes first
        self.job.rank_states.leaving(fault.node, leaving)
        after = (fault.node, leaving) if self.job.rank_states.holds(leaving) else None
        self.orders.promote(spare, PromoteMode.LIVE, after=after, switch_after=switch_after)
        self.job.enter(RunState.RECOVERING)

    def _regroup(self, plan: Plan) -> None:
        self.change_membership(plan.membership)
        self.ctx.events.append(
            ev.MIGRATION_STARTED,
            failed=[],
            spares=[],
            last_heartbeat=None,
            committed_step=None,
            detail=plan.detail,
            mode=plan.action.recovery,
            **self._chained_from(),
        )
        self.job.recovery_chained(plan.membership.epoch, self.ctx.clock.time(), None, (), Resolution.REGROUP)
        self.orders.reconfigure(list(plan.membership.active))
        self.job.enter(RunState.RECOVERING)

    def _restart(self, plan: Plan) -> None:
        self.job.enter(RunState.RECOVERING)
        new = plan.membership
        for spare, node in zip(plan.promoted, plan.lost_nodes, strict=True):
            self.ctx.events.append(
                ev.SPARE_PROMOTED, epoch=new.epoch, node=spare, replaces=node, ranks=list(new.ranks_of(spare))
            )
        self.change_membership(new)
        survivors = [n for n in new.active if n not in plan.promoted]
        committed = self.job.committed(survivors)
        self._migration_started(plan, committed)
        self._relaunch(survivors, plan, committed)

    def _restart_in_place(self, plan: Plan) -> None:
        self.job.enter(RunState.RECOVERING)
        self.job.restarted(in_place=True)
        committed = self.job.committed(list(self.job.membership.active))
        self.change_membership(plan.membership)
        self._migration_started(plan, committed)
        self._relaunch(list(plan.membership.active), plan, committed, in_place=True)

    def _migration_started(self, plan: Plan, committed: int | None) -> None:
        """``migration_started`` of a recovery from lost nodes: live, restart, restart in place."""
        failed = plan.lost_nodes
        why: dict[str, Any] = {"fallback": plan.fallback, "detail": plan.detail} if plan.fallback else {}
        if self._held is not None:  # the job held its step this long for a spare
            why["held_s"] = round(self.ctx.clock.time() - self._held.since, 3)
        self.ctx.events.append(
            ev.MIGRATION_STARTED,
            failed=failed,
            spares=list(plan.promoted),
            last_heartbeat=self.job.last_heartbeat(failed),
            committed_step=committed,
            mode=plan.action.recovery,
            **why,
            **self._chained_from(),
        )
        if plan.fallback:
            logger.warning("not live: %s", plan.detail)

    def _relaunch(self, relaunch: list[str], plan: Plan, committed: int | None, **restarted: Any) -> None:
        """Stop and relaunch ``relaunch`` in the new epoch, promote the spares; all resume."""
        new = self.job.membership
        self.launcher.stop([self.job.steps[n] for n in relaunch], self.ctx.config.stop_timeout)
        for node in relaunch:
            self.job.launched(node, self.launcher.launch(node, new))
        for spare in plan.promoted:
            self.orders.promote(spare, PromoteMode.RESTART)
        self.ctx.events.append(
            ev.RESTARTED,
            restarts=self.job.restarted(),
            active=list(new.active),
            spares=list(new.spares),
            from_checkpoint=True,
            **restarted,
        )
        now = self.ctx.clock.time()
        self.job.recovery_chained(new.epoch, now, committed, plan.lost_nodes, Resolution.CHECKPOINT)
        self.job.enter(RunState.LAUNCHING)

    def _chained_from(self) -> dict[str, int]:
        """``chained_from``: the epoch of the recovery in flight that a new one continues."""
        return {} if self.job.migration is None else {"chained_from": self.job.migration.epoch}

    def _drop_spares(self, plan: Plan) -> None:
        spares_left = len(plan.membership.spares) + len(plan.promoted)
        for node in plan.dropped:
            extra = {"reason": plan.detail} if plan.drained else {}
            self.ctx.events.append(
                ev.SPARE_LOST, epoch=plan.membership.epoch, node=node, spares_left=spares_left, **extra
            )
            if plan.drained:  # its standby tasks leave, then its node is released
                self.orders.stop_standby(node, f"node {plan.detail}")
                self.job.releasing_node(node)

    def finish(self, state: RunState, exit_code: int, message: str) -> None:
        """End the job: spares leave, every step stops, the end is logged."""
        for node in self.job.membership.spares:
            self.orders.stop_standby(node, message)
        self.launcher.stop(self.job.steps.values(), self.ctx.config.stop_timeout)
        self.job.enter(state)
        self.job.ended_with(exit_code, message)
        self.allocation.close()  # the releases in flight are logged before the end
        kind = ev.FINISHED if state == RunState.SUCCEEDED else ev.FAILED
        self.ctx.events.append(
            kind, exit_code=exit_code, message=message, restarts=self.job.restarts, **supervisor_cpu()
        )
        (logger.info if state == RunState.SUCCEEDED else logger.error)("%s (exit %d)", message, exit_code)


def record_loss(job: JobState, events: ev.EventLog, fault: Fault) -> None:
    """``fault`` lost its node's step: the step is LOST, the loss is logged as its detector's event."""
    step = job.steps[fault.node]
    m = job.membership
    role = m.role_of(fault.node) if fault.node in m.active + m.spares else step.role
    step.lost()
    events.append(
        _LOSS_EVENT[fault.detector],
        node=fault.node,
        role=role,
        detector=fault.detector,
        detail=fault.detail,
        exit_code=fault.exit_code,
        evidence=fault.evidence,
    )
    logger.warning("fault (%s): %s", fault.evidence or "-", fault.detail)


class InPlace:
    """Live moves in place (``supervisor/plan.py``): a node that outlived its rank's fault is its
    own spare. Once its old step has ended, a standby step starts there and is promoted live."""

    def __init__(self, job: JobState, launcher: StepLauncher, orders: Orders) -> None:
        self.job = job
        self.launcher = launcher
        self.orders = orders
        #: nodes waiting for their old step to end
        self._waiting: set[str] = set()

    def add(self, node: str, committed: int | None) -> None:
        """``node`` takes its rank back; ``committed``: the job's step now (repeated moves at one
        step are counted: a crash that repeats is a bug, and the planner bounds them)."""
        self.job.moved_in_place(committed)
        self._waiting.add(node)

    def advance(self) -> None:
        for node in sorted(self._waiting):
            if self.job.steps[node].poll() is None:
                continue  # SIGTERMed with the loss; the launcher kills it past lost_stop_timeout
            self._waiting.discard(node)
            if node not in self.job.membership.active:
                continue  # lost again meanwhile: planned afresh
            self.job.launched(node, self.launcher.launch(node, self.job.membership, role=NodeRole.SPARE))
            self.orders.promote(node, PromoteMode.LIVE)


def supervisor_cpu() -> dict[str, Any]:
    """CPU seconds this supervisor used (its threads), and its ``srun`` children that have ended:
    what a job under tp run costs beyond its training, in the ``finished`` / ``failed`` event."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "supervisor_cpu_s": round(own.ru_utime + own.ru_stime, 3),
        "srun_cpu_s": round(children.ru_utime + children.ru_stime, 3),
    }
