"""The job supervisor (``tp run``): membership, detection, in-allocation restart.

It runs in the batch step, on the batch host, and owns the job's control
plane. One ``srun --no-kill`` step per node runs the user's command: active
nodes hold the ranks, spare nodes run the same command in standby (imports
done, waiting in :func:`torchpass_slurm.rank.runtime.init`).

The monitor loop is a branch over :class:`RunState`::

    LAUNCHING ──every active rank said hello──► RUNNING
    RUNNING ──every active step exited 0──► SUCCEEDED
    RUNNING ──fault on an active node──► RECOVERING
    RECOVERING ──live: spare promoted, survivors reconfigured (epoch+1)──► first step ──► RUNNING
    RECOVERING ──restart: spare promoted, survivors relaunched (epoch+1)──► LAUNCHING
    RECOVERING ──no spare left──► FAILED
    RUNNING ──fault on a spare──► RUNNING (the pool shrinks)

A fault is whichever comes first of: the node's step exited non-zero, its
ranks stopped sending heartbeats, Slurm reports the node DOWN / FAIL /
NOT_RESPONDING or no longer lists it in the job, or a rank reports a failed
collective (then the settle window finds the culprit). Recovery is a live
migration when every surviving rank runs the elastic loop
(:mod:`torchpass_slurm.rank.elastic`): the spare takes the lost node's logical
ranks, the survivors rebuild their process group in place and a replica sends
the spare the state (docs/protocol.md, "Recovery"). Otherwise, or with
``--recovery restart``, it is an in-allocation restart: the other steps are
restarted and every rank resumes from the last checkpoint. Either way the job
id stays the same; nothing is requeued.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from datetime import timedelta
from pathlib import Path

from torchpass_slurm import events as ev
from torchpass_slurm.config import SupervisorConfig
from torchpass_slurm.control import messages as msg
from torchpass_slurm.control.server import ControlServer
from torchpass_slurm.supervisor.recovery import POLL_SLICE, Fault, Migration, MigrationMixin, RunState
from torchpass_slurm.errors import ControlPlaneError, TorchpassError
from torchpass_slurm.supervisor.membership import Membership
from torchpass_slurm.slurm import SlurmBackend
from torchpass_slurm.slurm.models import Node
from torchpass_slurm.supervisor.status import JobStatus, NodeStatus, write_status
from torchpass_slurm.supervisor.workers import StepLauncher, WorkerState, WorkerStep

logger = logging.getLogger(__name__)

#: How often status.json is rewritten (seconds).
STATUS_INTERVAL_S = 1.0


#: Facts a rank reports that go to the event log as they are.
RANK_EVENTS = frozenset({ev.GROUP_REBUILT, ev.AGREEMENT, ev.TRANSFER_DONE, ev.FIRST_STEP,
                         "released"})


@dataclass(frozen=True)
class RunResult:
    exit_code: int
    state: RunState
    epoch: int
    restarts: int
    message: str


class Supervisor(MigrationMixin):
    """Supervises one job's steps until the training ends; see the module docstring."""

    def __init__(self, *, job_id: int, run_dir: Path, membership: Membership,
                 launcher: StepLauncher, server: ControlServer, slurm: SlurmBackend,
                 events: ev.EventLog, config: SupervisorConfig,
                 store: tuple[str, int] = ("", 0), recovery: str = "live") -> None:
        self.job_id = job_id
        self.run_dir = run_dir
        self.membership = membership
        self.launcher = launcher
        self.server = server
        self.slurm = slurm
        self.events = events
        self.config = config
        self.state = RunState.LAUNCHING
        self.steps: dict[str, WorkerStep] = {}
        self.restarts = 0
        self.message = ""
        self._drains_seen: set[str] = set()
        self._next_slurm_poll = 0.0
        self._next_status = 0.0
        self._exit_code = 1
        #: a rank reported a failed collective; judged by the next _detect
        self._reported: Fault | None = None
        #: the live migration in progress (waiting for its first step)
        self.migration: Migration | None = None
        self.store_addr, self.store_port = store
        self.recovery = recovery
        #: objects that must live as long as the supervisor (the rendezvous store)
        self.keepalive: Any = None
        #: drains seen on the job's nodes, waiting for a step boundary to migrate
        self._drains: list[tuple[str, str]] = []
        #: drained nodes whose ranks are handing over / have left the job
        self._releasing: set[str] = set()
        self._released: set[str] = set()
        self._in_place_restarts = 0

    # -- the loop ----------------------------------------------------------
    def run(self) -> RunResult:
        m = self.membership
        self.events.epoch = m.epoch
        self.events.append(ev.STARTED, active=list(m.active), spares=list(m.spares),
                           world_size=m.world_size, ntasks_per_node=m.ntasks_per_node)
        for node in m.active + m.spares:
            self.steps[node] = self.launcher.launch(node, m)
        try:
            while self.state not in (RunState.SUCCEEDED, RunState.FAILED):
                self._pump(POLL_SLICE)
                fault = self._detect()
                if fault is not None:
                    self._handle(fault)
                elif self._drains and self.migration is None and self.state == RunState.RUNNING:
                    self._migrate_planned(*self._drains.pop(0))
                elif self._all_active_exited_ok():
                    self._finish(RunState.SUCCEEDED, 0, "training completed")
                self._write_status()
        except BaseException as err:
            if self.state not in (RunState.SUCCEEDED, RunState.FAILED):
                self._finish(RunState.FAILED, 1, f"supervisor stopped: {err!r}")
            raise
        finally:
            self._write_status(force=True)
        return RunResult(self._exit_code, self.state, self.membership.epoch, self.restarts,
                         self.message)

    # -- messages ----------------------------------------------------------
    def _pump(self, timeout: timedelta) -> None:
        received = self.server.poll(timeout)
        now = time.time()
        for _peer, m in received:
            node = m.sender.rsplit("/", 1)[0]
            step = self.steps.get(node)
            if step is None or step.state in (WorkerState.STOPPING, WorkerState.EXITED):
                continue
            if m.kind == msg.HELLO:
                if m.body.get("epoch", step.epoch) != step.epoch:
                    continue  # a straggler of an older launch on this node
                step.seen(m.sender, now)
                step.hello_senders.add(m.sender)
                if len(step.hello_senders) >= step.ntasks and step.state == WorkerState.STARTING:
                    step.state = WorkerState.RUNNING
                    self.events.append(ev.WORKER_UP, node=node, role=step.role,
                                       ranks=list(self.membership.ranks_of(node)))
            elif m.kind == msg.HEARTBEAT:
                step.seen(m.sender, now, m.body.get("step"))
            elif m.kind == msg.REPORT:
                self._on_report(node, step, m.body)
            elif m.kind == msg.STANDBY:
                step.standby_senders.add(m.sender)
                step.seen(m.sender, now)
                if step.all_standby() and step.state == WorkerState.STARTING:
                    step.state = WorkerState.STANDBY
                    self.events.append(ev.WORKER_UP, node=node, role="spare")
        if self.state == RunState.LAUNCHING and all(
                self.steps[n].state == WorkerState.RUNNING for n in self.membership.active):
            self.state = RunState.RUNNING

    def _on_report(self, node: str, step: WorkerStep, body: Mapping[str, Any]) -> None:
        """A rank's report; a malformed one is logged and dropped, never fatal."""
        try:
            self._apply_report(node, step, body)
        except (TorchpassError, TypeError, KeyError, ValueError) as err:
            logger.warning("ignoring a malformed %r report from %s: %s", body.get("event"), node,
                           err)

    def _apply_report(self, node: str, step: WorkerStep, body: Mapping[str, Any]) -> None:
        event = body["event"]
        fields = {k: v for k, v in dict(body["fields"]).items() if k not in ("ts", "kind", "job")}
        if event == "live_ready":
            step.live = True
        elif event == "collective_failed":
            if fields.get("epoch", step.epoch) >= step.epoch and self._reported is None:
                self._reported = Fault(node, "collective_failed",
                                       f"rank {fields.get('rank')} on {node}: a collective failed "
                                       f"({fields.get('error', '')[:120]})")
        elif event in RANK_EVENTS:
            self.events.append(event, node=node, **fields)
            mig = self.migration
            if event == ev.AGREEMENT and mig is not None and fields.get("epoch") == mig.epoch:
                mig.agreed = int(fields["committed_step"])
            if event == ev.FIRST_STEP and self.migration is not None:
                self._migration_done(fields)
        elif event == "resumed":
            self._restart_done(fields)
        elif event == "health_warning":
            self._health_warning(node, fields)
        else:
            logger.warning("ignoring an unknown report %r from %s", event, node)

    # -- detection ---------------------------------------------------------
    def _detect(self) -> Fault | None:
        reported, self._reported = self._reported, None
        return (self._detect_step_exit() or reported or self._detect_silence()
                or self._watch_slurm())

    def _detect_step_exit(self) -> Fault | None:
        for node, step in self.steps.items():
            if step.state in (WorkerState.STOPPING, WorkerState.EXITED, WorkerState.LOST):
                continue
            rc = step.poll()
            if rc is None:
                continue
            if node in self._releasing:
                step.state = WorkerState.EXITED
                self._release_node(node)
                continue
            if rc == 0 and step.role == "active":
                step.state = WorkerState.EXITED
                self.events.append(ev.STEP_EXITED, node=node, exit_code=0)
                continue
            return Fault(node, "step_exited", f"srun step on {node} exited with status {rc}", rc)
        return None

    def _detect_silence(self) -> Fault | None:
        now = time.time()
        for node, step in self.steps.items():
            if node in self._releasing:
                continue
            if step.state in (WorkerState.RUNNING, WorkerState.STANDBY):
                silent = step.silent_for(now)
                if silent is not None and silent > self.config.heartbeat_timeout:
                    return Fault(node, "heartbeat_lost",
                                 f"no heartbeat from {node} for {silent:.0f} s")
            elif step.state == WorkerState.STARTING and now - step.started > self.config.startup_timeout:
                return Fault(node, "startup_timeout",
                             f"{node} did not report within {self.config.startup_timeout:.0f} s")
        return None

    def _watch_slurm(self) -> Fault | None:
        """Poll Slurm for the job's nodes, at most every ``slurm_poll_interval`` seconds."""
        now = time.monotonic()
        if now < self._next_slurm_poll:
            return None
        self._next_slurm_poll = now + self.config.slurm_poll_interval
        watched = [n for n, s in self.steps.items()
                   if s.state not in (WorkerState.EXITED, WorkerState.LOST, WorkerState.STOPPING)]
        if not watched:
            return None
        try:
            job_nodes = set(self.slurm.job(self.job_id).nodes)
            nodes = {n.name: n for n in self.slurm.nodes(watched)}
        except Exception as err:  # the watcher must never kill the job
            logger.warning("Slurm watcher: %s", err)
            return None
        for name in watched:
            if job_nodes and name not in job_nodes:
                return Fault(name, "node_gone", f"Slurm no longer lists {name} in job {self.job_id}")
            node = nodes.get(name)
            if node is not None:
                fault = self._judge_node(node)
                if fault is not None:
                    return fault
        return None

    def _judge_node(self, node: Node) -> Fault | None:
        if node.is_down or "FAIL" in node.flags or not node.is_responding:
            return Fault(node.name, "node_down", f"Slurm reports {node.name} {node.state_text}")
        if node.is_drain and node.name not in self._drains_seen:
            self._drains_seen.add(node.name)
            self.events.append(ev.DRAIN_SEEN, node=node.name, reason=node.reason or "")
            self._drains.append((node.name, node.reason or ""))
        return None

    # -- recovery ----------------------------------------------------------
    def _handle(self, fault: Fault) -> None:
        settle = fault.kind in ("step_exited", "collective_failed")
        faults = self._settle(fault) if settle else [fault]
        self._reported = None  # reports gathered while settling belong to this fault
        if not faults:
            self._regroup(fault)
            return
        for f in faults:
            self._record(f)
        self.launcher.stop([self.steps[f.node] for f in faults], self.config.lost_stop_timeout)
        lost_active = []
        for f in faults:
            if self.steps[f.node].role == "spare":
                self.membership = self.membership.drop_spare(f.node)
                self.events.epoch = self.membership.epoch
                self.events.append(ev.SPARE_LOST, node=f.node,
                                   spares_left=len(self.membership.spares))
            else:
                lost_active.append(f)
        if lost_active:
            if self._can_migrate_live(lost_active):
                self._migrate_live(lost_active)
            else:
                self._restart_on_spares(lost_active)
        elif fault.kind == "collective_failed":
            self._regroup(fault)  # only a spare was lost: the active ranks still wait for an epoch
        if self.state not in (RunState.FAILED, RunState.SUCCEEDED):
            self._release_lost(faults)  # after the recovery has started: it waits for nobody

    def _settle(self, first: Fault) -> list[Fault]:
        """Find the cause of a step's error exit: a silent node, else the first to exit.

        When one node dies, the ranks on the others fail in their next
        collective and their steps exit too; blaming the first exit would
        blame a healthy node. So wait ``fault_settle`` seconds, then blame the
        nodes whose steps still run but went silent; if none did, the first
        step that exited is the cause (a crashed or killed rank process).
        """
        deadline = time.monotonic() + self.config.fault_settle
        while time.monotonic() < deadline:
            self._pump(POLL_SLICE)
        now = time.time()
        silent = [n for n in self.membership.active + self.membership.spares
                  if self.steps[n].poll() is None
                  and (self.steps[n].silent_for(now) or 0.0) > self.config.silence_threshold]
        if silent:
            return [Fault(n, "heartbeat_lost",
                          f"{n} went silent ({self.steps[n].silent_for(now):.0f} s) while "
                          f"{first.detail}") for n in silent]
        exited = [Fault(n, "step_exited", f"srun step on {n} exited with status {s.exit_code}",
                        s.exit_code)
                  for n, s in self.steps.items()
                  if s.state not in (WorkerState.EXITED, WorkerState.LOST, WorkerState.STOPPING)
                  and s.poll() not in (None, 0)]
        if first.kind == "step_exited":
            return [first]
        return exited[:1]

    def _record(self, fault: Fault) -> None:
        step = self.steps[fault.node]
        step.state = WorkerState.LOST
        kind = {"heartbeat_lost": ev.HEARTBEAT_LOST, "startup_timeout": ev.HEARTBEAT_LOST,
                "node_down": ev.NODE_DOWN, "node_gone": ev.NODE_DOWN}.get(fault.kind, ev.STEP_EXITED)
        self.events.append(kind, node=fault.node, role=step.role, detector=fault.kind,
                           detail=fault.detail, exit_code=fault.exit_code)
        logger.warning("fault: %s", fault.detail)

    def _send(self, sender: str, kind: str, body: dict[str, object]) -> None:
        """Best effort: a worker that is gone is found by the detectors, not here."""
        peer = self.server.peer_of(sender)
        if peer is None:
            logger.warning("cannot send %s to %s: never connected", kind, sender)
            return
        try:
            self.server.send(peer, kind, body)
        except ControlPlaneError as err:
            logger.warning("cannot send %s to %s: %s", kind, sender, err)

    # -- the end -----------------------------------------------------------
    def _all_active_exited_ok(self) -> bool:
        return all(self.steps[n].state == WorkerState.EXITED and self.steps[n].exit_code == 0
                   for n in self.membership.active)

    def _finish(self, state: RunState, exit_code: int, message: str) -> None:
        for node in self.membership.spares:
            step = self.steps.get(node)
            if step is None:
                continue
            for sender in step.standby_senders:
                self._send(sender, msg.STOP, {"reason": message})
        self.launcher.stop(self.steps.values(), self.config.stop_timeout)
        self.state, self._exit_code, self.message = state, exit_code, message
        kind = ev.FINISHED if state == RunState.SUCCEEDED else ev.FAILED
        self.events.append(kind, exit_code=exit_code, message=message, restarts=self.restarts)
        log = logger.info if state == RunState.SUCCEEDED else logger.error
        log("%s (exit %d)", message, exit_code)

    # -- status ------------------------------------------------------------
    def _write_status(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self._next_status:
            return
        self._next_status = now + STATUS_INTERVAL_S
        m = self.membership
        nodes = []
        for node, step in self.steps.items():
            role = m.role_of(node) if node in m.active + m.spares + m.failed else step.role
            if node in self._released or node in self._releasing:
                role = "released"
            ranks = tuple(m.ranks_of(node)) if role == "active" else ()
            nodes.append(NodeStatus(node=node, role=role, ranks=ranks, state=step.state.value,
                                    last_step=step.last_step, last_heartbeat=step.last_heartbeat,
                                    exit_code=step.exit_code))
        status = JobStatus(job_id=str(self.job_id), run_dir=str(self.run_dir),
                           state=self.state.value, epoch=m.epoch, world_size=m.world_size,
                           updated=time.time(), nodes=tuple(nodes), restarts=self.restarts,
                           message=self.message)
        try:
            write_status(self.run_dir, status)
        except OSError as err:
            logger.warning("could not write status.json: %s", err)

