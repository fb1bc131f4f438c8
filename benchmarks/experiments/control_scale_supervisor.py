"""The supervisor process of the control-plane scale benchmark: the real loop, Slurm simulated.

What runs is the supervisor of ``tp run`` as ``supervisor/assemble.py`` puts it together,
unchanged, with the Slurm side simulated through the seams the unit tests use (a
:class:`~torchpass_slurm.slurm.SlurmBackend` given to the real ``StepLauncher``, and a
:class:`~torchpass_slurm.supervisor.probe.Probe`)::

    Supervisor.run()   supervisor/loop.py: read passes, Detectors, plan_recovery, status.json, events
      ├─ CountingServer     the real ControlServer on 127.0.0.1 (CURVE, HMAC, schemas, replay
      │                     guard); it counts what its polls return and marks the window
      ├─ StepLauncher ──launch_step──► SimulatedSlurm ──► SimulatedStep: no process, no srun;
      │                     running (poll() is None) until stopped, or its agent's fault ends it
      ├─ SimulatedSlurmd    the probe of a silent node's slurmd: a powered-off node's does not
      │                     answer (the probe times out), any other node's accepts at once
      └─ ObservingExecutor  each plan recorded as the planner made it; the steps it finds lost
                            recorded lost, and no recovery carried out

A conductor thread follows the row: it says when every step is launched and up, takes the
:class:`~.control_scale_world.Schedule`, asks the loop's thread to snapshot its clocks at
the window's start and end (in ``CountingServer.poll``), and ends the loop as Ctrl-C does.
"""

from __future__ import annotations

import _thread
import cProfile
import dataclasses
import io
import itertools
import logging
import pstats
import resource
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from torchpass_slurm import config as cfg
from torchpass_slurm.control.messages import Message
from torchpass_slurm.control.security import DEFAULT_LIMITS, raise_fd_limit
from torchpass_slurm.control.server import ControlServer
from torchpass_slurm.rundir.events import EVENTS_FILE, EventLog
from torchpass_slurm.slurm.models import Job, Node
from torchpass_slurm.slurm.steps import StepRequest
from torchpass_slurm.supervisor.execute import Executor, record_loss
from torchpass_slurm.supervisor.loop import Supervisor
from torchpass_slurm.supervisor.membership import Membership
from torchpass_slurm.supervisor.plan import Plan
from torchpass_slurm.supervisor.probe import ProbeResult
from torchpass_slurm.supervisor.workers import StepLauncher, WorkerState

from .control_scale_world import (
    KILLED_STATUS,
    RANKS_PER_NODE,
    FaultKind,
    Row,
    Schedule,
    node_index,
    node_name,
)

JOB_ID = 27
#: Longest wait for every step to be launched, and then for every step to be up.
LAUNCH_TIMEOUT_S = 60.0
UP_TIMEOUT_S = 90.0
#: The loop runs this long after the fault phase, for a late detection; then it is stopped.
TAIL_S = 2.0
#: One message in this many has its delay (receipt time minus its ``ts``) sampled.
DELAY_SAMPLE = 16

#: (monotonic, process CPU time, loop thread's CPU time, messages accepted, polls)
Snapshot = tuple[float, float, float, int, int]


class World:
    """What the simulated Slurm knows of the faults: the schedule, once the conductor has it."""

    def __init__(self) -> None:
        #: node name -> when its node powers off / when its step ends (``time.monotonic``)
        self.down_at: dict[str, float] = {}
        self.exit_at: dict[str, float] = {}

    def strike(self, schedule: Schedule) -> None:
        for f in schedule.faults:
            if f.kind == FaultKind.NODE_STOPPED:
                self.down_at[node_name(f.node)] = f.at
            elif f.kind == FaultKind.AGENT_STEP_ENDED:
                self.exit_at[node_name(f.node)] = f.at

    def down(self, node: str, at: float) -> bool:
        """``node`` is powered off at ``at``."""
        return at >= self.down_at.get(node, float("inf"))


class SimulatedStep:
    """A node's srun step, as much of ``Popen`` as ``StepLauncher`` uses, with no process:
    running until a signal ends it (srun forwards it) or its agent's fault does."""

    _pids = itertools.count(100_000)

    def __init__(self, world: World, node: str) -> None:
        self.world, self.node = world, node
        self.pid = next(self._pids)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            ends = self.world.exit_at.get(self.node)
            if ends is not None and time.monotonic() >= ends:
                self.returncode = KILLED_STATUS
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            self.returncode = -sig

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None:
            raise subprocess.TimeoutExpired(["srun"], timeout or 0.0)
        assert self.returncode is not None
        return self.returncode


class SimulatedSlurm:
    """The Slurm calls the supervisor's loop makes (``launch_step``, and ``job`` and ``nodes``
    every ``slurm_poll_interval``), answered from the simulation: every node ALLOCATED and
    responding (slurmctld marks a dead node only after ``SlurmdTimeout``, minutes). Any other
    call fails the row, as the unit tests' FakeSlurm does. A launch must give the step what
    the simulated agents play (its rank base, epoch 0, per-node beats or not)."""

    name = "simulated"

    def __init__(self, world: World, membership: Membership, per_node: bool) -> None:
        self.world, self.membership, self.per_node = world, membership, per_node
        self.names = membership.active + membership.spares
        self._nodes = tuple(Node(n, "ALLOCATED") for n in self.names)
        self.launched = 0

    def job(self, job_id: int) -> Job:
        return Job(job_id, "simulated", "RUNNING", nodes=self.names)

    def nodes(self, names: Iterable[str] | None = None, *, partition: str | None = None) -> tuple[Node, ...]:
        return self._nodes

    def launch_step(self, step: StepRequest) -> SimulatedStep:
        env, node = step.env or {}, step.node
        expected = {cfg.ENV_EPOCH: "0", cfg.ENV_NODE_HEARTBEAT: "1" if self.per_node else "0"}
        if node in self.membership.active:
            expected[cfg.ENV_RANK_BASE] = str(node_index(node) * RANKS_PER_NODE)
        wrong = {k: env.get(k) for k, v in expected.items() if env.get(k) != v}
        if wrong or step.ntasks != RANKS_PER_NODE:
            raise AssertionError(
                f"the step of {node} is not what its agent plays: {wrong}, {step.ntasks} tasks"
            )
        self.launched += 1
        return SimulatedStep(self.world, node)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AssertionError(f"the supervisor called slurm.{name}(), which the simulation does not offer")


class SimulatedSlurmd:
    """The :class:`~torchpass_slurm.supervisor.probe.Probe` of a silent node's slurmd: a
    powered-off node's probe ends unreachable after ``timeout`` (a TCP connect to a dead host
    times out); any other node's slurmd accepts at once (a connect on a LAN takes < 1 ms)."""

    def __init__(self, world: World, timeout: float) -> None:
        self.world, self.timeout = world, timeout
        self.started = 0
        self._running: dict[str, tuple[float, float]] = {}  # node -> (monotonic, wall) at start
        self._done: dict[str, ProbeResult] = {}

    def start(self, node: str) -> None:
        if node not in self._running:
            self._running[node] = (time.monotonic(), time.time())
            self.started += 1

    def verdict(self, node: str, since: float) -> ProbeResult | None:
        began = self._running.get(node)
        if began is not None:
            mono, wall = began
            down = self.world.down(node, mono)
            if not down or time.monotonic() >= mono + self.timeout:
                del self._running[node]
                self._done[node] = self._result(node, wall, down)
        result = self._done.get(node)
        return result if result is not None and result.started >= since else None

    def _result(self, node: str, started: float, down: bool) -> ProbeResult:
        if down:
            return ProbeResult(started, False, f"{node}: its slurmd did not answer within {self.timeout:g} s")
        return ProbeResult(started, True, f"{node}: its slurmd accepts connections", slurmd=True)

    def node_of_address(self, address: str) -> str | None:
        return None  # no peer names an address: the simulated ranks report no failed collective

    def probe_now(self, node: str) -> ProbeResult:
        return self._result(node, time.time(), self.world.down(node, time.monotonic()))

    def close(self) -> None:
        pass


class CountingServer(ControlServer):
    """The real ControlServer; its polls (on the loop's thread) also count what they return,
    sample the messages' delays, and snapshot the thread's clocks when the conductor asks.

    Its gate admits ``connections`` in their handshake at once, not the default 256
    (``SocketLimits.max_pending``): the gate counts a connection as in its handshake for 6 s
    after it was accepted, done or not, and sheds the oldest past the budget; 1,024 agents
    connecting within seconds were shed and reconnected in a storm that did not end (10,879
    sheds in 12 s, 256 connections standing; with the budget raised, all up in a second).
    """

    def __init__(self, secret: bytes, *, connections: int, profile: bool = False) -> None:
        limits = dataclasses.replace(DEFAULT_LIMITS, max_pending=max(DEFAULT_LIMITS.max_pending, connections))
        super().__init__(secret, "127.0.0.1", 0, limits=limits)
        self.accepted = self.polls = 0
        self.delays: list[float] = []
        #: asked for by the conductor: "start", "end"; taken by the next poll
        self.marks: list[str] = []
        self.snapshots: dict[str, Snapshot] = {}
        # the loop thread's CPU time, not wall time: the host's other load is not the loop's
        self.profiler = cProfile.Profile(time.thread_time) if profile else None

    def poll(self, timeout: timedelta) -> list[tuple[bytes, Message]]:
        batch = super().poll(timeout)
        self.polls += 1
        self.accepted += len(batch)
        if "start" in self.snapshots and "end" not in self.snapshots and batch:
            now = time.time()
            self.delays.extend(now - m.ts for _, m in batch[::DELAY_SAMPLE])
        if self.marks:
            self._mark(self.marks.pop(0))
        return batch

    def _mark(self, mark: str) -> None:
        self.snapshots[mark] = self.snapshot()
        if self.profiler is not None:
            (self.profiler.enable if mark == "start" else self.profiler.disable)()

    def snapshot(self) -> Snapshot:
        return (time.monotonic(), time.process_time(), time.thread_time(), self.accepted, self.polls)


class ObservingExecutor(Executor):
    """The real executor's record of a loss, not its recovery: each plan is kept with the
    time it was made; each step it finds lost is recorded lost (``record_loss``: LOST, so no
    longer watched, and the loss in the event log); nothing else is done (no stop, promote or
    relaunch: carrying out a recovery of 16,384 ranks would need simulated ranks that play
    it, and is the recovery benchmark's subject)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.plans: list[tuple[float, Plan]] = []

    def execute(self, plan: Plan) -> None:
        self.plans.append((time.monotonic(), plan))
        for fault in plan.faults:
            if fault.loses_node and self.job.steps[fault.node].state != WorkerState.LOST:
                record_loss(self.job, self.ctx.events, fault)


def build(row: Row, server: ControlServer, world: World, run_dir: Path) -> tuple[Supervisor, SimulatedSlurm]:
    """The supervisor of a job of the row's nodes, as ``build_supervisor`` makes it for tp run."""
    names = [node_name(i) for i in range(row.nodes + row.spares)]
    membership = Membership.initial(names, row.nodes, RANKS_PER_NODE)
    config = cfg.SupervisorConfig(
        heartbeat_interval=row.interval_s,
        heartbeat_per_node_from=1 if row.per_node else len(names) + 1,
    )
    slurm = SimulatedSlurm(world, membership, row.per_node)
    launcher = StepLauncher(
        slurm,  # type: ignore[arg-type]  # the calls the loop makes, no more
        job_id=JOB_ID,
        command=("python", "train.py"),
        control_endpoint=server.endpoint,
        base_env={},
        heartbeat_per_node_from=config.heartbeat_per_node_from,
    )
    events = EventLog(run_dir / EVENTS_FILE, job=str(JOB_ID), epoch=membership.epoch)
    sup = Supervisor(
        job_id=JOB_ID,
        run_dir=run_dir,
        membership=membership,
        launcher=launcher,
        server=server,
        slurm=slurm,  # type: ignore[arg-type]
        events=events,
        config=config,
        probe=SimulatedSlurmd(world, config.probe_timeout),
        recovery="live",
        batch_host="127.0.0.1",
    )
    sup.executor = ObservingExecutor(sup.executor.ctx, launcher=launcher, server=server, store=sup.store)
    return sup, slurm


def wait_for(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def conduct(
    conn: Connection, sup: Supervisor, server: CountingServer, slurm: SimulatedSlurm, world: World
) -> None:
    """The conductor thread: see the module docstring. Any order but a Schedule ends the row
    at once."""
    total = len(slurm.names)
    launched = wait_for(lambda: slurm.launched >= total, LAUNCH_TIMEOUT_S)
    conn.send({"launched": launched})
    began = time.monotonic()

    def steps_up() -> int:
        return sum(s.state in (WorkerState.RUNNING, WorkerState.STANDBY) for s in list(sup.steps.values()))

    up = launched and wait_for(lambda: steps_up() == total, UP_TIMEOUT_S)
    conn.send({"up": up, "steps_up": steps_up(), "after_s": round(time.monotonic() - began, 2)})
    schedule = conn.recv()
    if isinstance(schedule, Schedule):
        world.strike(schedule)
        for mark, at in (("start", schedule.start), ("end", schedule.end)):
            time.sleep(max(0.0, at - time.monotonic()))
            server.marks.append(mark)
        time.sleep(max(0.0, schedule.over + TAIL_S - time.monotonic()))
    _thread.interrupt_main()  # the loop ends as a supervisor stopped with Ctrl-C does


def supervisor_main(conn: Connection, secret: bytes, row: Row, profile: bool) -> None:
    """The supervisor process: the endpoint to ``conn``; on "run" the loop and its conductor;
    the results to ``conn`` once the loop has ended."""
    raise_fd_limit()
    logging.getLogger("torchpass_slurm").setLevel(logging.CRITICAL)  # faults are counted, not logged
    world = World()
    server = CountingServer(secret, connections=row.nodes + row.spares + 64, profile=profile)
    with tempfile.TemporaryDirectory(prefix="control-scale-") as run_dir:
        sup, slurm = build(row, server, world, Path(run_dir))
        conn.send(server.endpoint)
        conn.recv()  # "run"
        conductor = threading.Thread(target=conduct, args=(conn, sup, server, slurm, world), daemon=True)
        conductor.start()
        try:
            sup.run()
        except KeyboardInterrupt:
            pass
        finally:
            sup.events.close()
            server.close()
        conductor.join()
        conn.send(results(sup, server))


def results(sup: Supervisor, server: CountingServer) -> dict[str, Any]:
    """What the loop did: its clocks over the window, the messages, every plan it made."""
    executor = sup.executor
    assert isinstance(executor, ObservingExecutor)
    out: dict[str, Any] = {
        "rejected": server.rejected,
        "rejected_by_cause": dict(server.refusals.counts),
        "refused_connections": dict(server.refused_connections.counts),
        "probes": sup.probe.started if isinstance(sup.probe, SimulatedSlurmd) else None,
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "delays_s": server.delays,
        "plans": [
            {
                "at": at,
                "action": str(plan.action),
                "faults": [
                    {
                        "node": f.node,
                        "detector": str(f.detector),
                        "evidence": str(f.evidence or ""),
                        "detail": f.detail,
                    }
                    for f in plan.faults
                ],
            }
            for at, plan in executor.plans
        ],
    }
    start, end = server.snapshots.get("start"), server.snapshots.get("end")
    if start is not None and end is not None:
        wall, cpu, thread, accepted, polls = (b - a for a, b in zip(start, end, strict=True))
        out.update(
            window_s=wall,
            cpu_share=cpu / wall,
            main_thread_share=thread / wall,
            rate=accepted / wall,
            polls_per_s=polls / wall,
            cpu_us_per_msg=cpu / accepted * 1e6 if accepted else None,
        )
    if server.profiler is not None:
        text = io.StringIO()
        pstats.Stats(server.profiler, stream=text).sort_stats("tottime").print_stats(25)
        out["profile"] = text.getvalue()
    return out
