"""How the supervisor recovers: live migration, planned migration, restart.

:class:`MigrationMixin` holds the recovery actions of
:class:`~torchpass_slurm.supervisor.loop.Supervisor`; the supervisor's loop
(detection, settle, the end of the job) decides when they run. See
``docs/protocol.md`` ("Recovery") for the messages and the rank side.

    live      every surviving rank runs the elastic loop: spare promoted, survivors
              reconfigured in place, a replica sends the spare the state
    planned   an admin drain: the same, at a step boundary; the node's ranks leave
              and the node is released from the job (it becomes DRAINED)
    restart   otherwise, or --recovery restart: survivors relaunched, all ranks
              resume from the last checkpoint
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from torchpass_slurm import events as ev
from torchpass_slurm.control import messages as msg
from torchpass_slurm.errors import NoSpareError
from torchpass_slurm.supervisor.workers import WorkerState, master_port

if TYPE_CHECKING:
    from torchpass_slurm.supervisor.loop import Supervisor

logger = logging.getLogger(__name__)

#: With no spare left, how often a job may restart in place (a crash that repeats is a bug).
MAX_IN_PLACE_RESTARTS = 3
#: How long one pass of the loop waits for control messages.
POLL_SLICE = timedelta(seconds=0.5)


class RunState(str, enum.Enum):
    LAUNCHING = "launching"
    RUNNING = "running"
    RECOVERING = "recovering"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclass(frozen=True)
class Fault:
    """Something lost a node's step; ``kind`` names the detector that saw it first."""

    node: str
    kind: str  # step_exited | heartbeat_lost | node_down | node_gone | startup_timeout
    detail: str
    exit_code: int | None = None


#: Fault kinds after which the node itself is not to be trusted (it is taken out of the job).
NODE_GONE = ("heartbeat_lost", "node_down")


@dataclass
class Migration:
    """A migration in progress, until its first step (live) or its resume (restart)."""

    epoch: int
    started: float
    committed: int | None  # the highest step survivors had reported before the fault
    failed: tuple[str, ...]
    resolution: str = "live"
    #: a planned migration (drain): it switches at a step boundary, nothing is recomputed
    planned: bool = False
    #: the committed step the ranks agreed on (their agreement report)
    agreed: int | None = None


class MigrationMixin:
    """The recovery actions of the supervisor (mixed into it; ``self`` is a Supervisor)."""

    # -- planned migration (an admin drain) ----------------------------------
    def _migrate_planned(self: Supervisor, node: str, reason: str) -> None:
        """Move a drained node's ranks to a spare at a step boundary, then release the node."""
        m = self.membership
        role = m.role_of(node) if node in m.active + m.spares else "gone"
        if role == "spare":
            self.membership = m.drop_spare(node)
            self.events.epoch = self.membership.epoch
            self.events.append(ev.SPARE_LOST, node=node, reason=f"drained: {reason}",
                               spares_left=len(self.membership.spares))
            step = self.steps[node]
            for sender in step.standby_senders:
                self._send(sender, msg.STOP, {"reason": f"node drained: {reason}"})
            self._releasing.add(node)
            return
        if role != "active":
            return
        if node == socket.gethostname():
            self.events.append(ev.DRAIN_DEFERRED, node=node, reason=reason,
                               detail="the batch host runs the supervisor and cannot leave the "
                                      "job: it drains when the job ends")
            return
        if not self._can_migrate_live([Fault(node, "drain", reason)]):
            self.events.append(ev.DRAIN_DEFERRED, node=node, reason=reason,
                               detail="no live migration possible (no spare, or a rank not on "
                                      "the elastic loop): the node drains when the job ends")
            return
        new = m.replace(node)
        spare = new.active[m.slot_of(node)]
        committed = self._committed(list(m.active))
        self.membership = new
        self.events.epoch = new.epoch
        self.events.append(ev.MIGRATION_STARTED, failed=[node], spares=[spare], mode="planned",
                           reason=reason, last_heartbeat=None, committed_step=committed)
        self.events.append(ev.SPARE_PROMOTED, node=spare, replaces=node, mode="live",
                           ranks=list(new.ranks_of(spare)))
        self.migration = Migration(epoch=new.epoch, started=time.time(), committed=committed,
                                   failed=(node,), planned=True)
        self._releasing.add(node)
        leave = list(m.ranks_of(node))
        self._reconfigure(list(m.active), planned=True, leave=leave)
        self._promote(spare, mode="live")
        self.state = RunState.RECOVERING

    def _nodes_still_usable(self: Supervisor, faults: list[Fault]) -> bool:
        """Only rank processes died (the steps exited) and Slurm still calls their nodes usable."""
        if any(f.kind != "step_exited" for f in faults):
            return False
        try:
            nodes = {n.name: n for n in self.slurm.nodes([f.node for f in faults])}
        except Exception as err:
            logger.warning("cannot ask Slurm about %s: %s", [f.node for f in faults], err)
            return False
        return all(f.node in nodes and nodes[f.node].is_usable for f in faults)

    def _restart_in_place(self: Supervisor, faults: list[Fault]) -> None:
        """No spare left, but the nodes are fine: restart every rank in place from the checkpoint."""
        failed = [f.node for f in faults]
        if self._in_place_restarts >= MAX_IN_PLACE_RESTARTS:
            self._finish(RunState.FAILED, faults[0].exit_code or 1,
                         f"{faults[0].detail}; no hot spare left and {self._in_place_restarts} "
                         "in-place restarts already: giving up (submit with more --spares)")
            return
        self._in_place_restarts += 1
        m = self.membership
        new = dataclasses.replace(m, epoch=m.epoch + 1)
        committed = self._committed(list(m.active))
        self.membership = new
        self.events.epoch = new.epoch
        self.events.append(ev.MIGRATION_STARTED, failed=failed, spares=[], mode="restart-in-place",
                           last_heartbeat=self._last_heartbeat(faults), committed_step=committed)
        self._relaunch_from_checkpoint(list(new.active), [], committed, faults, in_place=True)

    def _health_warning(self: Supervisor, node: str, fields: Mapping[str, Any]) -> None:
        """Pre-emptive migration: drain the node while it still works; the drain moves it."""
        if node not in self.membership.active or node in self._releasing | self._released:
            return
        summary = str(fields.get("summary", ""))
        reason = f"torchpass: pre-emptive: {fields.get('status', 'WARNING')}: {summary}"[:200]
        self.events.append(ev.HEALTH_WARNING, node=node, status=fields.get("status"),
                           summary=summary)
        try:
            self.slurm.drain(node, reason)
        except Exception as err:  # without the drain the node keeps its ranks
            logger.warning("could not drain %s after its health warning: %s", node, err)

    def _release_node(self: Supervisor, node: str) -> None:
        """The drained node's step has ended: give the node back to Slurm (it becomes DRAINED)."""
        self._releasing.discard(node)
        self._released.add(node)
        self._shrink_out([node], reason="drained")

    def _release_lost(self: Supervisor, faults: list[Fault]) -> None:
        """Take nodes that died or went silent out of the allocation.

        The job no longer uses them (a spare took their ranks, or the job
        restarts from a checkpoint elsewhere); left in it, they would hold the
        job in COMPLETING at its end until Slurm declared them DOWN
        (SlurmdTimeout). A rank that only crashed (``step_exited``) leaves a
        usable node, which an in-place restart may need: it stays.
        """
        gone = [f.node for f in faults if f.kind in NODE_GONE]
        if gone:
            self._shrink_out(gone, reason="lost")

    def _shrink_out(self: Supervisor, nodes: list[str], *, reason: str) -> None:
        """Shrink the job to its other nodes; a NODE_RELEASED event per node says how it went."""
        try:
            keep = [n for n in self.slurm.job(self.job_id).nodes if n not in nodes]
            if keep:
                self.slurm.shrink_job(self.job_id, keep)
        except Exception as err:  # the nodes leave when the job ends instead
            logger.warning("could not release %s from job %s: %s", ",".join(nodes), self.job_id, err)
            for node in nodes:
                self.events.append(ev.NODE_RELEASED, node=node, released=False, reason=reason,
                                   error=str(err))
            return
        for node in nodes:
            self.events.append(ev.NODE_RELEASED, node=node, released=True, reason=reason)

    def _restart_on_spares(self: Supervisor, faults: list[Fault]) -> None:
        """Every lost active node's slot to a spare; restart the others from the checkpoint."""
        self.state = RunState.RECOVERING
        if len(self.membership.spares) < len(faults) and self._nodes_still_usable(faults):
            self._restart_in_place(faults)
            return
        new = self.membership
        promoted = []
        for fault in faults:
            try:
                new = new.replace(fault.node)
            except NoSpareError:
                self._finish(RunState.FAILED, fault.exit_code or 1,
                             f"{fault.detail}; no hot spare left, the job cannot continue "
                             "(submit with more --spares)")
                return
            spare = new.active[self.membership.slot_of(fault.node)]
            promoted.append(spare)
            self.events.append(ev.SPARE_PROMOTED, epoch=new.epoch, node=spare,
                               replaces=fault.node, ranks=list(new.ranks_of(spare)))
        self.membership = new
        self.events.epoch = new.epoch
        survivors = [n for n in new.active if n not in promoted]
        committed = self._committed(survivors)
        self.events.append(ev.MIGRATION_STARTED, failed=[f.node for f in faults], spares=promoted,
                           last_heartbeat=self._last_heartbeat(faults), committed_step=committed,
                           mode="restart")
        self._relaunch_from_checkpoint(survivors, promoted, committed, faults)

    def _relaunch_from_checkpoint(self: Supervisor, relaunch: list[str], promoted: list[str],
                                  committed: int | None, faults: list[Fault],
                                  **restarted: Any) -> None:
        """Stop and relaunch ``relaunch`` in the new epoch, promote the spares; all resume."""
        new = self.membership
        self.launcher.stop([self.steps[n] for n in relaunch], self.config.stop_timeout)
        for node in relaunch:
            self.steps[node] = self.launcher.launch(node, new)
        for spare in promoted:
            self._promote(spare)
        self.restarts += 1
        self.events.append(ev.RESTARTED, restarts=self.restarts, active=list(new.active),
                           spares=list(new.spares), from_checkpoint=True, **restarted)
        self.migration = Migration(epoch=new.epoch, started=time.time(), committed=committed,
                                   failed=tuple(f.node for f in faults), resolution="checkpoint")
        self.state = RunState.LAUNCHING

    def _committed(self: Supervisor, nodes: list[str]) -> int | None:
        """The highest step these nodes reported (from heartbeats; may lag by one beat)."""
        return max((self.steps[n].last_step or 0) for n in nodes) if nodes else None

    # -- live migration ------------------------------------------------------
    def _can_migrate_live(self: Supervisor, faults: list[Fault]) -> bool:
        """Every surviving active rank runs the elastic loop, and a spare is there per loss."""
        lost = {f.node for f in faults}
        survivors = [self.steps[n] for n in self.membership.active if n not in lost]
        return (self.recovery == "live" and bool(survivors) and bool(self.store_port)
                and all(s.live and s.state == WorkerState.RUNNING for s in survivors)
                and len(self.membership.spares) >= len(lost))

    def _migrate_live(self: Supervisor, faults: list[Fault]) -> None:
        """Spares take the lost slots; survivors rebuild the group in place and resend state."""
        old = self.membership
        new = old
        for fault in faults:
            new = new.replace(fault.node)
        promoted = [new.active[old.slot_of(f.node)] for f in faults]
        survivors = [n for n in new.active if n not in promoted]
        committed = self._committed(survivors)
        self.membership = new
        self.events.epoch = new.epoch
        self.events.append(ev.MIGRATION_STARTED, failed=[f.node for f in faults],
                           spares=promoted, last_heartbeat=self._last_heartbeat(faults),
                           committed_step=committed, mode="live")
        for spare, fault in zip(promoted, faults):
            self.events.append(ev.SPARE_PROMOTED, node=spare, replaces=fault.node,
                               ranks=list(new.ranks_of(spare)), mode="live")
        prev = self.migration  # a fault during a migration: one recovery covers both
        self.migration = Migration(
            epoch=new.epoch, started=prev.started if prev else time.time(),
            committed=prev.committed if prev and prev.committed is not None else committed,
            failed=(prev.failed if prev else ()) + tuple(f.node for f in faults))
        self._reconfigure(survivors)
        for spare in promoted:
            self._promote(spare, mode="live")
        self.state = RunState.RECOVERING

    def _last_heartbeat(self: Supervisor, faults: list[Fault]) -> float | None:
        """When the lost nodes were last heard from: the start of the detection phase."""
        return max((self.steps[f.node].last_heartbeat or 0.0) for f in faults) or None

    def _reconfigure(self: Supervisor, nodes: list[str], *, planned: bool = False,
                     leave: list[int] | None = None) -> None:
        body: dict[str, object] = {
            "epoch": self.membership.epoch, "world_size": self.membership.world_size,
            "store_addr": self.store_addr, "store_port": self.store_port}
        if planned:
            body.update(planned=True, leave=leave or [])
        for node in nodes:
            step = self.steps[node]
            step.epoch = self.membership.epoch
            for sender in sorted(step.hello_senders):
                self._send(sender, msg.RECONFIGURE, body)

    def _regroup(self: Supervisor, fault: Fault) -> None:
        """A collective failed but no rank is lost: rebuild the group, same members."""
        self.membership = dataclasses.replace(self.membership, epoch=self.membership.epoch + 1)
        self.events.epoch = self.membership.epoch
        self.events.append(ev.MIGRATION_STARTED, failed=[], spares=[], last_heartbeat=None,
                           committed_step=None, detail=fault.detail, mode="regroup")
        self.migration = Migration(epoch=self.membership.epoch, started=time.time(),
                                   committed=None, failed=(), resolution="regroup")
        self._reconfigure(list(self.membership.active))

    def _migration_done(self: Supervisor, fields: Mapping[str, Any]) -> None:
        mig = self.migration
        if (mig is None or mig.resolution not in ("live", "regroup")
                or fields.get("epoch", mig.epoch) != mig.epoch):
            return
        lost = (None if mig.committed is None or mig.agreed is None
                else max(0, mig.committed - mig.agreed))
        self.events.append(ev.MIGRATION_DONE, resolution=mig.resolution, lost_steps=lost,
                           recomputed_steps=0 if mig.planned else 1, planned=mig.planned, failed=list(mig.failed),
                           seconds=round(time.time() - mig.started, 3))
        self.migration = None
        self.state = RunState.RUNNING

    def _restart_done(self: Supervisor, fields: Mapping[str, Any]) -> None:
        """Rank 0 resumed from the checkpoint after a restart: the steps since it are lost."""
        mig = self.migration
        if mig is None or mig.resolution != "checkpoint" or fields.get("epoch") != mig.epoch:
            return
        resumed = int(fields.get("step", 0))
        lost = None if mig.committed is None else max(0, mig.committed - resumed)
        self.events.append(ev.MIGRATION_DONE, resolution="checkpoint", lost_steps=lost,
                           recomputed_steps=lost, resumed_step=resumed, failed=list(mig.failed),
                           seconds=round(time.time() - mig.started, 3))
        self.migration = None

    def _promote(self: Supervisor, node: str, mode: str = "restart") -> None:
        """Tell the spare's standby tasks their ranks; wait for their standby first."""
        step = self.steps[node]
        deadline = time.monotonic() + self.config.startup_timeout
        while not step.all_standby() and time.monotonic() < deadline and step.poll() is None:
            self._pump(POLL_SLICE)
        m = self.membership
        step.role = "active"
        step.epoch = m.epoch
        step.state = WorkerState.STARTING
        step.heartbeats.clear()
        step.hello_senders.clear()
        step.started = time.time()
        for sender in sorted(step.standby_senders):
            local = int(sender.rsplit("/", 1)[1])
            self._send(sender, msg.PROMOTE, {
                "rank": m.rank_base(node) + local, "local_rank": local,
                "world_size": m.world_size, "master_addr": m.node_of_rank(0),
                "master_port": master_port(self.job_id, m.epoch), "epoch": m.epoch,
                "mode": mode, "store_addr": self.store_addr, "store_port": self.store_port})
