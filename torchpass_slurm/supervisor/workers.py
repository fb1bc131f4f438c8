"""Worker steps: one ``srun --no-kill`` step per node, as the supervisor sees it.

A :class:`WorkerStep` is the supervisor's handle on one node's step: the srun
process, the control-plane senders of its tasks (``NODE/LOCALID``), the last
heartbeat and step each reported (its own, or relayed by its node's local
rank 0 in a per-node heartbeat). :class:`StepLauncher` starts steps with the
environment of ``docs/design/runtime-contract.md`` and stops them with a
bounded wait. Nothing here decides anything; :mod:`.supervisor` does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from torchpass_slurm import config as cfg
from torchpass_slurm.control.rank_bodies import Heartbeat, Hello, Standby, TaskBeat
from torchpass_slurm.phase import Phase
from torchpass_slurm.slurm import SlurmBackend
from torchpass_slurm.slurm.steps import EXPANDED_NODE_UNSET, StepRequest
from torchpass_slurm.strenum import StrEnum
from torchpass_slurm.supervisor.membership import Membership

logger = logging.getLogger(__name__)


class WorkerState(StrEnum):
    """Life of one node's step.

    ::

        STARTING ──hello──► RUNNING ──exit 0──► EXITED
           │   └──standby──► STANDBY ──promote──► RUNNING
           └──────── exit≠0 / heartbeat lost / node down ──► LOST
        any ──supervisor stops it──► STOPPING ──► EXITED
    """

    STARTING = "starting"
    RUNNING = "running"
    STANDBY = "standby"
    STOPPING = "stopping"
    EXITED = "exited"
    LOST = "lost"


@dataclass
class WorkerStep:
    """The supervisor's handle on one node's step."""

    node: str
    role: cfg.NodeRole
    epoch: int
    ntasks: int
    process: subprocess.Popen[bytes]
    started: float
    state: WorkerState = WorkerState.STARTING
    #: control-plane sender -> last heartbeat time
    heartbeats: dict[str, float] = field(default_factory=dict)
    standby_senders: set[str] = field(default_factory=set)
    hello_senders: set[str] = field(default_factory=set)
    #: tasks that spoke after the step was declared lost (told to stop, ignored)
    fenced: set[str] = field(default_factory=set)
    #: tasks that said bye: they are leaving (their process may take seconds to exit) and
    #: their silence is not a fault
    said_bye: set[str] = field(default_factory=set)
    #: its ranks run the elastic loop (they can rebuild their group in place)
    live: bool = False
    #: control-plane sender -> the committed step and the phase (``torchpass_slurm.phase``)
    #: of its last heartbeat
    phases: dict[str, tuple[int | None, str]] = field(default_factory=dict)
    last_step: int | None = None
    exit_code: int | None = None
    #: with per-node heartbeats: the task that beats for the node (its local rank 0), and the
    #: tasks whose process it found gone
    relay: str | None = None
    gone: set[str] = field(default_factory=set)
    #: tasks whose last word was that their collective failed: alive, tearing their group down
    #: (a teardown may hold the GIL, and the task's heartbeat thread with it)
    tearing: set[str] = field(default_factory=set)

    @property
    def last_heartbeat(self) -> float | None:
        return min(self.heartbeats.values()) if len(self.heartbeats) >= self.ntasks else None

    def all_standby(self) -> bool:
        return len(self.standby_senders) >= self.ntasks

    def poll(self) -> int | None:
        """The srun exit code once the step has ended, else None."""
        if self.exit_code is None:
            self.exit_code = self.process.poll()
        return self.exit_code

    def seen(self, sender: str, now: float, step: int | None = None, phase: str | None = None) -> None:
        self.heartbeats[sender] = now
        self.tearing.discard(sender)
        if phase is not None:
            self.phases[sender] = (step, phase)
        if step is not None and (self.last_step is None or step > self.last_step):
            self.last_step = step

    def hello(self, sender: str, hello: Hello, now: float) -> bool:
        """``sender`` said hello; True when that made the whole step up (it is now RUNNING). A
        hello of another epoch is a straggler of an older launch on this node: ignored."""
        if hello.epoch is not None and hello.epoch != self.epoch:
            return False
        self.seen(sender, now)
        self.hello_senders.add(sender)
        if len(self.hello_senders) < self.ntasks or self.state != WorkerState.STARTING:
            return False
        self.state = WorkerState.RUNNING
        self.all_up(now)
        return True

    def heartbeat(self, sender: str, beat: Heartbeat, now: float) -> None:
        """A heartbeat of ``sender`` (with per-node heartbeats, its node's other tasks too)."""
        if sender not in self.hello_senders and sender not in self.standby_senders:
            # a straggler of an older launch on this node, stopping: its steps are not this
            # launch's (after a checkpoint restart they sat above the steps recomputed, and
            # the job looked stuck: issue 24); this launch's tasks greet first
            return
        self.seen(sender, now, beat.step, beat.state)
        if beat.tasks is not None:  # a per-node heartbeat: its node's other tasks, relayed
            self.relayed(sender, beat.tasks, now)

    def standby(self, sender: str, standby: Standby, now: float) -> bool:
        """``sender`` (a spare's task) waits; True when that made the whole step STANDBY."""
        self.standby_senders.add(sender)
        self.seen(sender, now)
        if not self.all_standby() or self.state != WorkerState.STARTING:
            return False
        self.state = WorkerState.STANDBY
        return True

    def lost(self) -> None:
        """A fault took the step (its node, or a rank of it): it is watched no more."""
        self.state = WorkerState.LOST

    def exited(self) -> None:
        """The step ended well (its training finished, or a drained node's ranks left)."""
        self.state = WorkerState.EXITED

    def all_up(self, now: float) -> None:
        """Every task said hello: silence counts from now. With per-node heartbeats a task that
        was up first beats through local rank 0, which cannot relay before it is up itself: on
        a loaded host local rank 1 said hello 11 s before local rank 0 and its step was declared
        silent the moment it was whole (seen on the dev cluster)."""
        for sender, heard in self.heartbeats.items():
            self.heartbeats[sender] = max(heard, now)

    def recovering(self, sender: str, now: float) -> None:
        """``sender`` says its collective failed: it is alive, and tearing its group down."""
        step = self.phases.get(sender, (None, ""))[0]
        self.seen(sender, now, step, Phase.RECOVERING)
        self.tearing.add(sender)

    def relayed(self, relay: str, tasks: Iterable[TaskBeat], now: float) -> None:
        """The other tasks a per-node heartbeat from ``relay`` (its node's local rank 0) carries:
        each (``control/rank_bodies.py``) marks ``NODE/local_rank`` heard ``age_ms`` before
        ``now``, with its step and phase, unless something newer was heard from it, and records
        whether its process lives. Local ranks outside the step, and the relay's own, are ignored."""
        self.relay = relay
        own = relay.rsplit("/", 1)[-1]
        for task in tasks:
            if task.local_rank >= self.ntasks or str(task.local_rank) == own:
                continue
            sender, heard = f"{self.node}/{task.local_rank}", now - task.age_ms / 1000
            if task.alive is False:
                self.gone.add(sender)
            else:
                self.gone.discard(sender)
            if heard >= self.heartbeats.get(sender, heard):
                self.seen(sender, heard, task.step, task.state)

    def silent_for(self, now: float) -> float | None:
        """Seconds since the stalest task of this step that should still beat was heard from
        (None: not all heard yet, or every task said bye)."""
        if len(self.heartbeats) < self.ntasks:
            return None
        beating = [t for sender, t in self.heartbeats.items() if sender not in self.said_bye]
        return now - min(beating) if beating else None

    def lost_for(self, now: float, *, tearing: bool = False) -> float | None:
        """The silence that blames the node itself: that of its stalest task with per-rank
        beats; with per-node beats, its relay's, or that of a task whose process the relay
        found gone (a task stuck while its node beats and its process lives is :meth:`stuck`,
        not this). Tasks whose last word was a failed collective count only with ``tearing``:
        their silence is judged by ``teardown_timeout``, never by a peer naming them."""
        if len(self.heartbeats) < self.ntasks or self.said_bye.issuperset(self.heartbeats):
            return None  # what silent_for says with None, without its minimum: twice a check per step
        if self.relay is None or self.relay in self.said_bye:
            counted = list(self.heartbeats)
        else:
            counted = [self.relay, *self.gone]
        heard = [
            self.heartbeats[s]
            for s in counted
            if s in self.heartbeats and s not in self.said_bye and (tearing or s not in self.tearing)
        ]
        return now - min(heard) if heard else None

    def stuck(self, now: float) -> list[tuple[str, float, str]]:
        """With per-node beats: the tasks that are silent while their node beats and their
        process lives, as (sender, seconds silent, last phase), stalest first."""
        if self.relay is None or len(self.heartbeats) < self.ntasks:
            return []
        found = [
            (sender, now - heard, self.phases.get(sender, (None, ""))[1])
            for sender, heard in self.heartbeats.items()
            if sender != self.relay and sender not in self.gone and sender not in self.said_bye
        ]
        return sorted(found, key=lambda f: -f[1])

    def tearing_for(self, now: float) -> tuple[str, float] | None:
        """The task silent longest since its failed collective was its last word, and for how
        long (None: no such task)."""
        found = [(s, now - self.heartbeats[s]) for s in self.tearing if s not in self.said_bye]
        return max(found, key=lambda f: f[1]) if found else None


class Clock(Protocol):
    """Wall and monotonic time (``time`` is one; the tests pass a virtual clock)."""

    def time(self) -> float: ...

    def monotonic(self) -> float: ...


def master_port(job_id: int, epoch: int) -> int:
    """The rendezvous port of an epoch: a new one every epoch, spread by job id."""
    return 20000 + (job_id * 97) % 20000 + epoch % 1000


class StepLauncher:
    """Starts and stops the per-node steps of one job."""

    def __init__(
        self,
        slurm: SlurmBackend,
        *,
        job_id: int,
        command: Sequence[str],
        control_endpoint: str,
        base_env: Mapping[str, str],
        clock: Clock = time,
        heartbeat_per_node_from: int | None = None,
        step_args: Sequence[str] = (),
        job_env: Mapping[str, str] | None = None,
    ) -> None:
        self.slurm = slurm
        #: the job's own environment, which srun passes on under ``base_env`` (None: tp run's own)
        self.job_env = job_env
        #: srun options of every step, e.g. ``--het-group=1`` (the training component of a
        #: heterogeneous job whose component 0 runs the supervisor)
        self.step_args = tuple(step_args)
        self.clock = clock
        self.job_id = job_id
        self.command = tuple(command)
        self.control_endpoint = control_endpoint
        self.base_env = dict(base_env)
        #: jobs of at least this many nodes get per-node heartbeats (None: the setting's value,
        #: from ``TORCHPASS_HEARTBEAT_PER_NODE_FROM`` or its default)
        self.heartbeat_per_node_from = (
            cfg.SupervisorConfig.from_env().heartbeat_per_node_from
            if heartbeat_per_node_from is None
            else heartbeat_per_node_from
        )
        #: lost steps told to stop: (step, when its srun is killed if it is still there)
        self._kill_at: list[tuple[WorkerStep, float]] = []
        #: nodes merged into the job by expansion (spare refills): their steps are launched
        #: without a cpus-per-task request (``EXPANDED_NODE_UNSET``)
        self.expanded: set[str] = set()

    def launch(self, node: str, membership: Membership, *, role: cfg.NodeRole | None = None) -> WorkerStep:
        """Start ``node``'s step in its role of ``membership``, or as ``role`` (a standby on an
        active node that is its own spare: ``supervisor/execute.py``)."""
        role = membership.role_of(node) if role is None else role
        env = dict(self.base_env)
        # NCCL's in-process recovery settings where the job set none (config.NCCL_RECOVERY_ENV):
        # every step gets them, as only a NCCL communicator reads them (docs/design/nccl.md)
        env.update(cfg.nccl_recovery_env({**(os.environ if self.job_env is None else self.job_env), **env}))
        env.update(
            {
                cfg.ENV_JOB_ID: str(self.job_id),
                cfg.ENV_CONTROL: self.control_endpoint,
                cfg.ENV_NODE: node,
                cfg.ENV_ROLE: role.value,
                cfg.ENV_EPOCH: str(membership.epoch),
                cfg.ENV_NTASKS_PER_NODE: str(membership.ntasks_per_node),
            }
        )
        per_node = len(membership.active) + len(membership.spares) >= self.heartbeat_per_node_from
        env[cfg.ENV_NODE_HEARTBEAT] = "1" if per_node else "0"  # never inherited from the job
        if role == cfg.NodeRole.ACTIVE:
            env.update(
                {
                    cfg.ENV_RANK_BASE: str(membership.rank_base(node)),
                    "WORLD_SIZE": str(membership.world_size),
                    "MASTER_ADDR": membership.node_of_rank(0),
                    "MASTER_PORT": str(master_port(self.job_id, membership.epoch)),
                }
            )
        process = self.slurm.launch_step(
            StepRequest(
                tuple(self.command),
                node,
                ntasks=membership.ntasks_per_node,
                job_name=f"tp-{role}-{node}-e{membership.epoch}",
                extra_args=("--kill-on-bad-exit=0", *self.step_args),
                env=env,
                unset_env=EXPANDED_NODE_UNSET if node in self.expanded else (),
            )
        )
        logger.info("launched %s step on %s (epoch %d, pid %d)", role, node, membership.epoch, process.pid)
        return WorkerStep(
            node=node,
            role=role,
            epoch=membership.epoch,
            ntasks=membership.ntasks_per_node,
            process=process,
            started=self.clock.time(),
        )

    def stop_lost(self, steps: Iterable[WorkerStep], timeout: float) -> None:
        """SIGTERM the srun of steps declared lost, without waiting: a dead node cannot answer
        and the recovery must not wait for it. :meth:`enforce` kills what is left after
        ``timeout`` (the loop calls it every pass)."""
        deadline = self.clock.monotonic() + timeout
        for s in steps:
            if s.poll() is None:
                _signal(s.process, signal.SIGTERM)
                self._kill_at.append((s, deadline))

    def enforce(self) -> None:
        """SIGKILL the srun of every lost step past its stop deadline."""
        now, waiting = self.clock.monotonic(), []
        for s, deadline in self._kill_at:
            if s.poll() is not None:
                continue
            if now < deadline:
                waiting.append((s, deadline))
                continue
            logger.warning("lost step on %s did not stop; killing its srun", s.node)
            _signal(s.process, signal.SIGKILL)
        self._kill_at = waiting

    def stop(self, steps: Iterable[WorkerStep], timeout: float) -> None:
        """SIGTERM every step's srun (srun forwards it to the tasks); SIGKILL after ``timeout``."""
        pending = [s for s in steps if s.poll() is None]
        for s in pending:
            if s.state != WorkerState.LOST:
                s.state = WorkerState.STOPPING
            _signal(s.process, signal.SIGTERM)
        deadline = self.clock.monotonic() + timeout
        for s in pending:
            remaining = max(0.0, deadline - self.clock.monotonic())
            try:
                s.process.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                logger.warning("step on %s did not stop within %.0f s; killing srun", s.node, timeout)
                _signal(s.process, signal.SIGKILL)
                s.process.wait()
            s.poll()
            if s.state == WorkerState.STOPPING:
                s.state = WorkerState.EXITED


def _signal(process: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(sig)
