"""Fakes for the supervisor's unit tests: a virtual clock, srun processes, Slurm, the control plane.

The real :class:`~torchpass_slurm.supervisor.loop.Supervisor` and the real
:class:`~torchpass_slurm.supervisor.workers.StepLauncher` run unchanged against them::

    Supervisor ──launch──► StepLauncher ──launch_step──► FakeSlurm ──► FakeProcess
        │   ▲                                                │  (the test decides when it exits)
        │   └──poll: hello / standby / heartbeat ◄── World ◄─┘  (a SimStep per launched step)
        └──send: promote / stop ──► FakeServer ──► World  (promote: the spare says hello;
                                                           stop: its step exits 0)

:class:`ElasticRanks` adds the reports of ranks that run ``ElasticTrainer``
(``live_ready``, ``collective_failed``, and the replies to ``reconfigure``
and a live ``promote``); :meth:`World.report` scripts any other report.

Every :meth:`FakeServer.poll` advances the :class:`VirtualClock` by its
timeout and lets the :class:`World` act, so a job of 30 virtual seconds runs
in milliseconds. Unlike the real server, a poll always takes its whole timeout.
"""

from __future__ import annotations

import itertools
import signal
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

from torchpass_slurm import config as cfg
from torchpass_slurm.control import messages as msg
from torchpass_slurm.control.bodies import Report
from torchpass_slurm.control.messages import Message, ReportKind, encode
from torchpass_slurm.control.rank_bodies import Heartbeat, Hello, Standby, TaskBeat
from torchpass_slurm.errors import ControlPlaneError, SlurmError
from torchpass_slurm.slurm.models import Job, Node
from torchpass_slurm.slurm.steps import StepRequest
from torchpass_slurm.supervisor.probe import ProbeResult
from torchpass_slurm.supervisor.workers import StepLauncher, WorkerStep

#: Any key will do: the fake server encodes every message only to check its kind and body.
SECRET = b"k" * 32
#: A run that has not ended after this many virtual seconds is a supervisor that never stops.
VIRTUAL_TIME_LIMIT_S = 600.0


class VirtualClock:
    """Stands in for the ``time`` module: wall and monotonic clocks that move only when told.

    The two clocks start far apart, so code that mixes them up fails loudly.
    """

    WALL0 = 1_700_000_000.0
    MONO0 = 5_000.0

    def __init__(self) -> None:
        self.elapsed = 0.0

    def time(self) -> float:
        return self.WALL0 + self.elapsed

    def monotonic(self) -> float:
        return self.MONO0 + self.elapsed

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, f"the clock cannot go back ({seconds})"
        self.elapsed += seconds


class FakeProcess:
    """The srun process of one step, with the part of ``Popen`` that StepLauncher uses.

    SIGTERM ends it (status -15) unless ``ignores_sigterm`` (srun stuck on a
    dead node); SIGKILL always does. ``wait(timeout)`` on a process that does
    not end advances the clock by ``timeout`` and raises TimeoutExpired.
    """

    _pids = itertools.count(1000)

    def __init__(self, clock: VirtualClock, *, ignores_sigterm: bool = False) -> None:
        self.clock = clock
        self.pid = next(self._pids)
        self.returncode: int | None = None
        self.signals: list[int] = []
        self.ignores_sigterm = ignores_sigterm
        self.on_exit: list[Callable[[], None]] = []

    def exit(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            for hook in self.on_exit:
                hook()

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is not None:
            return  # Popen.send_signal on a reaped process does nothing
        self.signals.append(sig)
        if sig == signal.SIGKILL or not self.ignores_sigterm:
            self.exit(-sig)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if timeout is None:
                raise AssertionError(f"wait() without a timeout on pid {self.pid}, which never ends")
            self.clock.advance(timeout)
            raise subprocess.TimeoutExpired(["srun"], timeout)
        return self.returncode


@dataclass
class Launch:
    """One ``launch_step`` call, as FakeSlurm saw it."""

    node: str
    env: dict[str, str]
    ntasks: int
    process: FakeProcess

    @property
    def role(self) -> str:
        return self.env[cfg.ENV_ROLE]

    @property
    def epoch(self) -> int:
        return int(self.env[cfg.ENV_EPOCH])


class FakeSlurm:
    """The few SlurmBackend calls the supervisor makes; any other call fails the test.

    ``job_nodes`` is what ``job()`` lists; ``node_states`` what ``nodes()``
    reports; ``error``, when set, is raised by both (a broken watcher).
    """

    name = "fake"

    def __init__(self, clock: VirtualClock, nodes: Sequence[str]) -> None:
        self.clock = clock
        self.job_nodes = list(nodes)
        self.node_states = {n: Node(n, "ALLOCATED") for n in nodes}
        self.error: Exception | None = None
        self.queries = 0
        self.launches: list[Launch] = []
        self.hang_on_stop: set[str] = set()
        self.on_launch: list[Callable[[Launch], None]] = []
        self.shrinks: list[list[str]] = []  # keep_nodes of every shrink_job()
        self.drains: list[tuple[str, str]] = []  # (node, reason) of every drain()
        #: nodes job expansion can give (the cluster's idle ones), and slurmctld's PrologFlags
        self.idle: list[str] = []
        self.prolog_flags = ""
        self.slurmd_timeout = "300 sec"
        #: what every shrink raises (Slurm 22.05 without accounting refuses them all)
        self.shrink_error: SlurmError | None = None
        self.expansions: list[tuple[str, ...]] = []  # nodes each expand_job() gave (or () refused)
        self.withdrawn = 0  # cancel_expansion() calls
        #: node -> when its slurmd started (wall seconds); a node not here says nothing
        self.started: dict[str, float] = {}
        self.unset_env: dict[str, tuple[str, ...]] = {}  # node -> unset_env of its last launch

    def set_node(self, name: str, state: str = "ALLOCATED", *flags: str, reason: str | None = None) -> None:
        self.node_states[name] = Node(name, state, frozenset(flags), reason)

    def job(self, job_id: int) -> Job:
        self.queries += 1
        if self.error is not None:
            raise self.error
        return Job(job_id, "train", "RUNNING", nodes=tuple(self.job_nodes))

    def drain(self, node: str, reason: str) -> None:
        """As ``scontrol update NodeName=... State=DRAIN``: the node is MIXED+DRAIN while the job holds it."""
        self.drains.append((node, reason))
        self.set_node(node, "MIXED", "DRAIN", reason=reason)

    def shrink_job(self, job_id: int, keep_nodes: Iterable[str]) -> None:
        if self.shrink_error is not None:
            raise self.shrink_error
        self.shrinks.append(list(keep_nodes))
        self.job_nodes = list(self.shrinks[-1])

    def nodes(self, names: Iterable[str] | None = None, *, partition: str | None = None) -> tuple[Node, ...]:
        if self.error is not None:
            raise self.error
        wanted = list(self.node_states) if names is None else list(names)
        return tuple(self.node_states[n] for n in wanted if n in self.node_states)

    def expand_job(self, job_id: int, *, wait_s: int, exclude: Iterable[str] = ()) -> tuple[str, ...]:
        """As job expansion: the first idle node not excluded joins the job; SlurmError if none."""
        free = [n for n in self.idle if n not in set(exclude) and n not in self.job_nodes]
        if not free:
            self.expansions.append(())
            raise SlurmError(f"salloc: error: Unable to allocate resources within {wait_s} s")
        self.idle.remove(free[0])
        self.job_nodes.append(free[0])
        self.set_node(free[0])
        self.expansions.append((free[0],))
        return (free[0],)

    def cancel_expansion(self, job_id: int) -> None:
        self.withdrawn += 1

    def slurmd_started(self, names: Iterable[str]) -> dict[str, float]:
        return {n: self.started[n] for n in names if n in self.started}

    def config_value(self, key: str) -> str | None:
        return {"PrologFlags": self.prolog_flags, "SlurmdTimeout": self.slurmd_timeout}.get(key)

    def launch_step(self, step: StepRequest) -> FakeProcess:
        node = step.node
        self.unset_env[node] = step.unset_env
        process = FakeProcess(self.clock, ignores_sigterm=node in self.hang_on_stop)
        launch = Launch(node, dict(step.env or {}), step.ntasks, process)
        self.launches.append(launch)
        for hook in self.on_launch:
            hook(launch)
        return process

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AssertionError(f"the supervisor called slurm.{name}(), which this fake does not offer")


class FakeLauncher(StepLauncher):
    """The real StepLauncher on FakeSlurm, recording every stop: (nodes, timeout)."""

    def __init__(self, slurm: FakeSlurm, clock: VirtualClock, *, job_id: int) -> None:
        super().__init__(
            slurm,
            job_id=job_id,
            command=("python", "train.py"),  # type: ignore[arg-type]
            control_endpoint="tcp://batch:5555",
            base_env={},
            clock=clock,
        )
        self.stops: list[tuple[list[str], float]] = []

    def stop(self, steps: Iterable[WorkerStep], timeout: float) -> None:
        steps = list(steps)
        self.stops.append(([s.node for s in steps], timeout))
        super().stop(steps, timeout)

    def stop_lost(self, steps: Iterable[WorkerStep], timeout: float) -> None:
        steps = list(steps)
        self.stops.append(([s.node for s in steps], timeout))
        super().stop_lost(steps, timeout)


@dataclass(frozen=True)
class Sent:
    peer: bytes
    message: Message


class FakeServer:
    """ControlServer's API (poll, send, peer_of) over an in-memory queue.

    :meth:`inject` queues a worker's message for the next poll; :meth:`send`
    records what the supervisor sends (checked against the real body schemas)
    and raises ControlPlaneError, as the real ROUTER socket does, for a peer
    that has disconnected.
    """

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.inbox: list[tuple[bytes, Message]] = []
        #: every worker message injected, in order (the contract test decodes them all)
        self.injected: list[Message] = []
        self.sent: list[Sent] = []
        self.disconnected: set[bytes] = set()
        self.on_poll: list[Callable[[], None]] = []
        self.on_send: list[Callable[[bytes, Message], None]] = []
        self._peers: dict[str, bytes] = {}
        self._seq = itertools.count(1)

    def inject(self, peer: bytes, sender: str, kind: str, body: Mapping[str, Any]) -> None:
        message = Message(kind, sender, next(self._seq), self.clock.time(), dict(body))
        encode(message, SECRET)
        self._peers[sender] = peer
        self.inbox.append((peer, message))
        self.injected.append(message)

    def poll(self, timeout: timedelta) -> list[tuple[bytes, Message]]:
        self.clock.advance(timeout.total_seconds())
        if self.clock.elapsed > VIRTUAL_TIME_LIMIT_S:
            raise RuntimeError(f"the supervisor still runs after {VIRTUAL_TIME_LIMIT_S:.0f} virtual s")
        for hook in self.on_poll:
            hook()
        batch, self.inbox = self.inbox, []
        return batch

    def send(self, peer_id: bytes, kind: str, body: Mapping[str, Any]) -> Message:
        if peer_id in self.disconnected:
            raise ControlPlaneError(f"cannot send {kind!r} to peer {peer_id.hex()}: it is not connected")
        message = Message(kind, "supervisor", next(self._seq), self.clock.time(), dict(body))
        encode(message, SECRET)
        self.sent.append(Sent(peer_id, message))
        for hook in self.on_send:
            hook(peer_id, message)
        return message

    def peer_of(self, sender: str) -> bytes | None:
        return self._peers.get(sender)

    def sent_of(self, kind: str) -> list[Sent]:
        return [s for s in self.sent if s.message.kind == kind]


@dataclass
class SimStep:
    """The tasks of one launched step, as the World plays them."""

    launch: Launch
    incarnation: int
    role: str
    epoch: int
    rank_base: int | None
    since: float  # elapsed time of the launch or the promotion
    greeted_at: float | None = None  # elapsed time of its hello (active) or standby (spare)
    peers: dict[str, bytes] = field(default_factory=dict)  # sender -> peer id
    stopped: set[str] = field(default_factory=set)  # senders that obeyed a STOP
    held: int | None = None  # the step its heartbeats carry while its training is stuck
    #: node beats: the last beat local rank 0 heard of each other task: (elapsed time, body)
    relayed: dict[str, tuple[float, Heartbeat]] = field(default_factory=dict)

    def step_at(self, elapsed: float) -> int:
        """The step its heartbeats carry: one per virtual second, unless held."""
        return int(elapsed) if self.held is None else self.held

    @property
    def node(self) -> str:
        return self.launch.node

    @property
    def process(self) -> FakeProcess:
        return self.launch.process


class World:
    """Well-behaved workers unless told otherwise; one tick per supervisor poll.

    An active step says hello (with its epoch), heartbeats every tick and
    exits 0 ``train_s`` after its hello. A spare says standby, heartbeats,
    says hello when promoted; each of its tasks leaves when told to stop, and
    its step exits 0 once all have (a step that exits takes its tasks with it). A node in :attr:`silent`
    sends nothing any more; :attr:`hello_delay` holds back a node's first
    message by that many seconds; :attr:`phase` sets the phase a node's heartbeats
    carry; a task in :attr:`quiet` stops beating while its process lives, one in :attr:`dead`
    stops beating because its process died (a later step on its node has new processes).
    :meth:`at` runs an action at an elapsed time.

    ``node_beats`` plays per-node heartbeats (``TORCHPASS_NODE_HEARTBEAT=1``): in an active step
    only local rank 0 sends heartbeats, with ``tasks``, the last beat it heard of each other task,
    its age and whether its process lives; a quiet or dead task keeps its old entry, older every
    tick (``rank/nodebeat.py``).
    """

    def __init__(
        self,
        clock: VirtualClock,
        server: FakeServer,
        slurm: FakeSlurm,
        *,
        train_s: float | None = 8.0,
        node_beats: bool = False,
    ) -> None:
        self.clock = clock
        self.server = server
        self.train_s = train_s
        self.node_beats = node_beats
        self.current: dict[str, SimStep] = {}
        self.silent: set[str] = set()
        self.quiet: set[str] = set()
        self.dead: set[str] = set()
        self.hello_delay: dict[str, float] = {}
        #: reports sent that the typed report refused (only tests of malformed reports send any)
        self.malformed_sent = 0
        #: the phase (``torchpass_slurm.phase``) an active node's heartbeats carry; default "training"
        self.phase: dict[str, str] = {}
        self._actions: list[tuple[float, Callable[[], None]]] = []
        self._by_peer: dict[bytes, SimStep] = {}
        self._incarnations: dict[str, int] = {}
        #: called with a step right after its tasks said hello (active) or standby (spare)
        self.on_greet: list[Callable[[SimStep], None]] = []
        server.on_poll.append(self.tick)
        server.on_send.append(self._receive)
        slurm.on_launch.append(self._launched)

    # -- what a test scripts --
    def at(self, elapsed: float, action: Callable[[], None]) -> None:
        self._actions.append((elapsed, action))
        self._actions.sort(key=lambda a: a[0])

    def crash(self, node: str, code: int, *, at: float) -> None:
        """The node's current step exits with ``code`` at ``at``."""
        self.at(at, lambda: self.current[node].process.exit(code))

    def go_silent(self, node: str, *, at: float) -> None:
        """The node dies: its tasks stop talking; its srun neither exits nor answers SIGTERM."""

        def die() -> None:
            self.silent.add(node)
            self.current[node].process.ignores_sigterm = True

        self.at(at, die)

    def go_quiet(self, sender: str, *, at: float) -> None:
        """One task stops beating (its heartbeat thread is stuck); the rest of its node goes on."""
        self.at(at, lambda: self.quiet.add(sender))

    def kill_task(self, sender: str, *, at: float) -> None:
        """One task's process dies (SIGKILL); its step runs on with the others (``srun`` does
        not end a step for one task's death)."""
        self.at(at, lambda: self.dead.add(sender))

    def report(self, node: str, event: ReportKind | str, *, at: float, local: int = 0, **fields: Any) -> None:
        """At ``at``, task ``local`` of the node's step then current sends a REPORT."""
        self.at(at, lambda: self.send_report(self.current[node], f"{node}/{local}", event, **fields))

    def send_report(self, sim: SimStep, sender: str, event: ReportKind | str, **fields: Any) -> None:
        """What ``Runtime.report`` sends (its rank added); a dead or silent step sends nothing."""
        if sim.process.poll() is not None or sim.node in self.silent or sim.node != sender.split("/")[0]:
            return
        wire = {"rank": self.rank_of(sim, sender), **fields}
        try:  # built and checked with the rank side's typed report, as Runtime.report does
            body = Report.of(event, **wire).to_body()
        except ControlPlaneError:  # a test's deliberately malformed report goes out as it is
            self.malformed_sent += 1
            body = {"event": str(event), "fields": wire}
        self.server.inject(sim.peers[sender], sender, msg.REPORT, body)

    def sim_of(self, peer: bytes) -> SimStep:
        return self._by_peer[peer]

    # -- the simulation --
    def tick(self) -> None:
        while self._actions and self._actions[0][0] <= self.clock.elapsed:
            _, action = self._actions.pop(0)
            action()
        for sim in list(self.current.values()):
            self._act(sim)

    def _launched(self, launch: Launch) -> None:
        n = self._incarnations[launch.node] = self._incarnations.get(launch.node, 0) + 1
        base = launch.env.get(cfg.ENV_RANK_BASE)
        sim = SimStep(
            launch, n, launch.role, launch.epoch, None if base is None else int(base), self.clock.elapsed
        )
        for local in range(launch.ntasks):
            peer = f"{launch.node}/{local}#{n}".encode()
            sim.peers[f"{launch.node}/{local}"] = peer
            self._by_peer[peer] = sim
            # new processes: a task that went quiet or died was one of the step before
            self.quiet.discard(f"{launch.node}/{local}")
            self.dead.discard(f"{launch.node}/{local}")
        launch.process.on_exit.append(lambda: self.server.disconnected.update(sim.peers.values()))
        self.current[launch.node] = sim

    def _act(self, sim: SimStep) -> None:
        if sim.process.poll() is not None or sim.node in self.silent:
            return
        now = self.clock.elapsed
        if sim.greeted_at is None:
            if now - sim.since >= self.hello_delay.get(sim.node, 0.0):
                for sender, peer in sim.peers.items():
                    self.server.inject(peer, sender, *self._greeting(sim, sender))
                sim.greeted_at = now
                for hook in self.on_greet:
                    hook(sim)
            return
        beats = {}
        for sender in sim.peers:
            if sender in sim.stopped or sender in self.quiet or sender in self.dead:
                continue
            state = self.phase.get(sim.node, "training") if sim.role == "active" else "standby"
            beats[sender] = Heartbeat(rank=self.rank_of(sim, sender), step=sim.step_at(now), state=state)
        if self.node_beats and sim.role == "active":
            self._node_beat(sim, beats)
        else:
            for sender, beat in beats.items():
                self.server.inject(sim.peers[sender], sender, msg.HEARTBEAT, beat.to_body())
        if sim.role == "active" and self.train_s is not None and now - sim.greeted_at >= self.train_s:
            sim.process.exit(0)

    def _node_beat(self, sim: SimStep, beats: dict[str, Heartbeat]) -> None:
        """Local rank 0 hears the others' beats and sends one heartbeat for the node."""
        now, leader = self.clock.elapsed, f"{sim.node}/0"
        sim.relayed.update({s: (now, b) for s, b in beats.items() if s != leader})
        if leader not in beats:
            return
        tasks = tuple(
            TaskBeat(
                int(s.rsplit("/", 1)[1]), b.rank, b.step, b.state, round((now - t) * 1000), s not in self.dead
            )
            for s, (t, b) in sorted(sim.relayed.items())
        )
        beat = replace(beats[leader], tasks=tasks)
        self.server.inject(sim.peers[leader], leader, msg.HEARTBEAT, beat.to_body())

    def _greeting(self, sim: SimStep, sender: str) -> tuple[str, dict[str, Any]]:
        local = int(sender.rsplit("/", 1)[1])
        if sim.role == "spare":
            return msg.STANDBY, Standby(node=sim.node, local_rank=local, pid=sim.process.pid).to_body()
        return msg.HELLO, Hello(
            node=sim.node,
            rank=self.rank_of(sim, sender),
            local_rank=local,
            role="active",
            pid=sim.process.pid,
            epoch=sim.epoch,
        ).to_body()

    @staticmethod
    def rank_of(sim: SimStep, sender: str) -> int | None:
        return None if sim.rank_base is None else sim.rank_base + int(sender.rsplit("/", 1)[1])

    def _receive(self, peer: bytes, message: Message) -> None:
        sim = self._by_peer[peer]
        if message.kind == msg.PROMOTE:
            sim.role, sim.epoch = "active", message.body["epoch"]
            sim.rank_base = message.body["rank"] - message.body["local_rank"]
            sim.since, sim.greeted_at = self.clock.elapsed, None
        elif message.kind == msg.STOP:
            sender = next(s for s, p in sim.peers.items() if p == peer)
            sim.stopped.add(sender)
            self.server.disconnected.add(peer)
            if len(sim.stopped) == len(sim.peers):
                sim.process.exit(0)


#: What a gloo collective says when a peer was killed (a text ``is_comm_error`` accepts).
GLOO_RESET = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"


class ElasticRanks:
    """The rank side of live migration, played on a World: what ``ElasticTrainer`` reports.

    Every task of an active step on a node of ``nodes`` (None: every node)
    reports ``live_ready`` right after its hello, as ``ElasticTrainer.start``
    does; a node left out never does (its training has no elastic loop). Then,
    each reply ``delay`` virtual seconds after its cause::

        reconfigure epoch N ──► group_rebuilt               (each survivor task joins epoch N)
        reconfigure planned, leave ──► released             (each leaving task; its step exits 0)
        promote mode=live   ──► hello, live_ready           (each spare task joins epoch N, step -1)
        every rank of epoch N joined ──► agreement (rank 0), transfer_done (each receiver)
                                    ──► first_step (rank 0)

    :meth:`fail_collective` fails the collective of every running active
    rank: they stop committing (their heartbeats hold their step) and the
    reporters say ``collective_failed``. An epoch in :attr:`stall` never
    reaches its agreement (a fault during the migration). ``agreed_lag``
    makes the agreed step that much lower than the highest step held.
    """

    def __init__(
        self, world: World, nodes: Iterable[str] | None = None, *, delay: float = 0.5, agreed_lag: int = 0
    ) -> None:
        self.world = world
        self.nodes = None if nodes is None else set(nodes)
        self.delay = delay
        self.agreed_lag = agreed_lag
        self.stall: set[int] = set()
        #: the ``mesh`` field of every live_ready (a sharded trainer's layout); per node in ``mesh_of``
        self.mesh: Any = None
        self.mesh_of: dict[str, Any] = {}
        self._world_size: dict[int, int] = {}
        self._joined: dict[int, dict[str, tuple[SimStep, int]]] = {}
        self._live_spares: dict[str, int] = {}  # node -> epoch of its promote mode=live
        world.on_greet.append(self._greeted)
        world.server.on_send.append(self._received)

    def fail_collective(self, *reporters: str, at: float, error: str | None = None) -> None:
        """At ``at`` every running active rank stops committing; the reporters' tasks say
        ``collective_failed`` with ``error`` (default: gloo's reset, naming nobody)."""

        def fail() -> None:
            stuck = [
                s
                for s in self.world.current.values()
                if s.role == "active"
                and s.greeted_at is not None
                and s.process.poll() is None
                and s.node not in self.world.silent
            ]
            for sim in stuck:
                sim.held = sim.step_at(self.world.clock.elapsed)
            for sim in stuck:
                if sim.node in reporters:
                    for sender in sim.peers:
                        self.world.send_report(
                            sim,
                            sender,
                            ReportKind.COLLECTIVE_FAILED,
                            step=sim.held,
                            error=error or GLOO_RESET,
                            epoch=sim.epoch,
                        )

        self.world.at(at, fail)

    def _elastic(self, node: str) -> bool:
        return self.nodes is None or node in self.nodes

    def _later(self, action: Callable[[], None]) -> None:
        self.world.at(self.world.clock.elapsed + self.delay, action)

    def _greeted(self, sim: SimStep) -> None:
        if sim.role != "active" or not self._elastic(sim.node):
            return
        mesh = self.mesh_of.get(sim.node, self.mesh)
        extra = {} if mesh is None else {"mesh": mesh}
        for sender in sim.peers:
            self.world.send_report(sim, sender, ReportKind.LIVE_READY, step=0, epoch=sim.epoch, **extra)
        epoch = self._live_spares.pop(sim.node, None)
        if epoch is not None:
            for sender in sim.peers:
                self._join(epoch, sim, sender, -1)

    def _received(self, peer: bytes, message: Message) -> None:
        sim = self.world.sim_of(peer)
        sender = next(s for s, p in sim.peers.items() if p == peer)
        body = message.body
        if message.kind == msg.RECONFIGURE:
            epoch = body["epoch"]
            self._world_size[epoch] = body["world_size"]
            if sim.held is None:
                sim.held = sim.step_at(self.world.clock.elapsed)
            if self.world.rank_of(sim, sender) in body.get("leave", ()):
                self._later(lambda: self._leave(sim, sender, epoch))
                return

            def rejoin() -> None:
                sim.epoch = epoch
                self.world.send_report(sim, sender, ReportKind.GROUP_REBUILT, seconds=self.delay, epoch=epoch)
                self._join(epoch, sim, sender, sim.step_at(self.world.clock.elapsed))

            self._later(rejoin)
        elif message.kind == msg.PROMOTE and body["mode"] == "live":
            self._world_size[body["epoch"]] = body["world_size"]
            self._live_spares[sim.node] = body["epoch"]

    def _leave(self, sim: SimStep, sender: str, epoch: int) -> None:
        """A rank of a drained node hands over and leaves; the step ends once all its tasks left."""
        self.world.send_report(sim, sender, ReportKind.RELEASED, step=sim.held, epoch=epoch)
        sim.stopped.add(sender)
        if len(sim.stopped) == len(sim.peers):
            sim.process.exit(0)

    def _join(self, epoch: int, sim: SimStep, sender: str, step: int) -> None:
        if sim.process.poll() is not None or sim.node in self.world.silent:
            return
        joined = self._joined.setdefault(epoch, {})
        joined[sender] = (sim, step)
        if len(joined) == self._world_size[epoch] and epoch not in self.stall:
            self._later(lambda: self._agree(epoch))

    def _agree(self, epoch: int) -> None:
        ranks = {
            self.world.rank_of(sim, sender): (sim, sender, step)
            for sender, (sim, step) in self._joined[epoch].items()
        }
        top = max(step for _, _, step in ranks.values())
        donors = sorted(r for r, (_, _, step) in ranks.items() if step == top)
        receivers = sorted(r for r, (_, _, step) in ranks.items() if step < top)
        agreed = top - self.agreed_lag
        sim0, sender0, _ = ranks[0]
        self.world.send_report(
            sim0,
            sender0,
            ReportKind.AGREEMENT,
            committed_step=agreed,
            receivers=receivers,
            donors=donors,
            epoch=epoch,
        )
        for i, rank in enumerate(receivers):
            sim, sender, _ = ranks[rank]
            self.world.send_report(
                sim,
                sender,
                ReportKind.TRANSFER_DONE,
                donor=donors[i % len(donors)],
                receiver=rank,
                step=agreed,
                bytes=4096,
                seconds=0.1,
                retries=0,
                resumed_from=0,
                epoch=epoch,
            )

        def first_step() -> None:
            for sim, _, _ in ranks.values():
                sim.held = None
            self.world.send_report(sim0, sender0, ReportKind.FIRST_STEP, step=agreed + 1, epoch=epoch)

        self._later(first_step)


def address_of(node: str) -> str:
    """The fake cluster's address of ``cN``: 10.0.0.N."""
    return f"10.0.0.{node.lstrip('c')}"


def gloo_reset_by(node: str) -> str:
    """gloo's words when the connection to ``node`` was closed (names its address)."""
    return f"{GLOO_RESET} [{address_of(node)}]:41234"


class FakeProbe:
    """The slurmd probe of :mod:`torchpass_slurm.supervisor.probe` on the virtual clock: a probe
    takes ``latency`` seconds; nodes in :attr:`gone` do not answer, the others do."""

    def __init__(self, clock: VirtualClock, *, latency: float = 0.3) -> None:
        self.clock = clock
        self.latency = latency
        self.gone: set[str] = set()
        self.started: list[tuple[float, str]] = []
        #: nodes probed with probe_now, in order
        self.now_probed: list[str] = []
        self._running: dict[str, float] = {}
        self._done: dict[str, ProbeResult] = {}

    def start(self, node: str) -> None:
        if node not in self._running:
            self._running[node] = self.clock.time()
            self.started.append((self.clock.elapsed, node))

    def verdict(self, node: str, since: float) -> ProbeResult | None:
        began = self._running.get(node)
        if began is not None and self.clock.time() >= began + self.latency:
            del self._running[node]
            self._done[node] = ProbeResult(began, node not in self.gone, f"{node}: fake probe")
        result = self._done.get(node)
        return result if result is not None and result.started >= since else None

    def node_of_address(self, address: str) -> str | None:
        return f"c{address.rsplit('.', 1)[1]}" if address.startswith("10.0.0.") else None

    def probe_now(self, node: str) -> ProbeResult:
        """At once (the pool's thread would wait ``latency`` in real time)."""
        up = node not in self.gone
        self.now_probed.append(node)
        return ProbeResult(self.clock.time(), up, f"{node}: fake probe", slurmd=up)

    def close(self) -> None:
        pass
