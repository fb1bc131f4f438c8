"""Fakes for the supervisor's unit tests: a virtual clock, srun processes, Slurm, the control plane.

The real :class:`~torchpass_slurm.supervisor.Supervisor` and the real
:class:`~torchpass_slurm.workers.StepLauncher` run unchanged against them::

    Supervisor ──launch──► StepLauncher ──launch_step──► FakeSlurm ──► FakeProcess
        │   ▲                                                │  (the test decides when it exits)
        │   └──poll: hello / standby / heartbeat ◄── World ◄─┘  (a SimStep per launched step)
        └──send: promote / stop ──► FakeServer ──► World  (promote: the spare says hello;
                                                           stop: its step exits 0)

Every :meth:`FakeServer.poll` advances the :class:`VirtualClock` by its
timeout and lets the :class:`World` act, so a job of 30 virtual seconds runs
in milliseconds. Unlike the real server, a poll always takes its whole timeout.
"""

from __future__ import annotations

import itertools
import signal
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from torchpass_slurm import config as cfg
from torchpass_slurm.control import messages as msg
from torchpass_slurm.control.messages import Message, encode
from torchpass_slurm.errors import ControlPlaneError
from torchpass_slurm.slurm.models import Job, Node
from torchpass_slurm.workers import StepLauncher, WorkerStep

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

    def set_node(self, name: str, state: str = "ALLOCATED", *flags: str, reason: str | None = None) -> None:
        self.node_states[name] = Node(name, state, frozenset(flags), reason)

    def job(self, job_id: int) -> Job:
        self.queries += 1
        if self.error is not None:
            raise self.error
        return Job(job_id, "train", "RUNNING", nodes=tuple(self.job_nodes))

    def nodes(self, names: Iterable[str] | None = None, *, partition: str | None = None) -> tuple[Node, ...]:
        if self.error is not None:
            raise self.error
        wanted = list(self.node_states) if names is None else list(names)
        return tuple(self.node_states[n] for n in wanted if n in self.node_states)

    def launch_step(self, command: Sequence[str], *, node: str, job_id: int | None = None,
                    ntasks: int = 1, job_name: str | None = None, extra_args: Sequence[str] = (),
                    env: Mapping[str, str] | None = None) -> FakeProcess:
        process = FakeProcess(self.clock, ignores_sigterm=node in self.hang_on_stop)
        launch = Launch(node, dict(env or {}), ntasks, process)
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

    def __init__(self, slurm: FakeSlurm, *, job_id: int) -> None:
        super().__init__(slurm, job_id=job_id, command=("python", "train.py"),  # type: ignore[arg-type]
                         control_endpoint="tcp://batch:5555", base_env={})
        self.stops: list[tuple[list[str], float]] = []

    def stop(self, steps: Iterable[WorkerStep], timeout: float) -> None:  # type: ignore[override]
        steps = list(steps)
        self.stops.append(([s.node for s in steps], timeout))
        StepLauncher.stop(steps, timeout)


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
    message by that many seconds. :meth:`at` runs an action at an elapsed time.
    """

    def __init__(self, clock: VirtualClock, server: FakeServer, slurm: FakeSlurm, *,
                 train_s: float | None = 8.0) -> None:
        self.clock = clock
        self.server = server
        self.train_s = train_s
        self.current: dict[str, SimStep] = {}
        self.silent: set[str] = set()
        self.hello_delay: dict[str, float] = {}
        self._actions: list[tuple[float, Callable[[], None]]] = []
        self._by_peer: dict[bytes, SimStep] = {}
        self._incarnations: dict[str, int] = {}
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
        sim = SimStep(launch, n, launch.role, launch.epoch, None if base is None else int(base),
                      self.clock.elapsed)
        for local in range(launch.ntasks):
            peer = f"{launch.node}/{local}#{n}".encode()
            sim.peers[f"{launch.node}/{local}"] = peer
            self._by_peer[peer] = sim
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
            return
        for sender, peer in sim.peers.items():
            if sender in sim.stopped:
                continue
            state = "training" if sim.role == "active" else "standby"
            self.server.inject(peer, sender, msg.HEARTBEAT,
                               {"rank": self._rank(sim, sender), "step": int(now), "state": state})
        if sim.role == "active" and self.train_s is not None and now - sim.greeted_at >= self.train_s:
            sim.process.exit(0)

    def _greeting(self, sim: SimStep, sender: str) -> tuple[str, dict[str, Any]]:
        local = int(sender.rsplit("/", 1)[1])
        if sim.role == "spare":
            return msg.STANDBY, {"node": sim.node, "local_rank": local, "pid": sim.process.pid}
        return msg.HELLO, {"node": sim.node, "rank": self._rank(sim, sender), "local_rank": local,
                           "role": "active", "pid": sim.process.pid, "epoch": sim.epoch}

    @staticmethod
    def _rank(sim: SimStep, sender: str) -> int | None:
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
