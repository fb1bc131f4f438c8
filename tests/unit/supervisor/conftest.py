"""A supervisor wired to the fakes, on a virtual clock: ``make(active=3, spares=1)``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from torchpass_slurm.config import SupervisorConfig
from torchpass_slurm.control import messages as msg
from torchpass_slurm.rundir import events as ev
from torchpass_slurm.rundir.status import JobStatus, read_status
from torchpass_slurm.supervisor.loop import RunResult, Supervisor
from torchpass_slurm.supervisor.membership import Membership

from .fakes import ElasticRanks, FakeLauncher, FakeProbe, FakeServer, FakeSlurm, VirtualClock, World

JOB_ID = 4242
#: Small timings, so that every scenario plays out in well under a minute of virtual time.
CONFIG = SupervisorConfig(
    heartbeat_interval=0.5,
    heartbeat_timeout=5,
    fault_settle=2,
    silence_threshold=1.5,
    slurm_poll_interval=1,
    startup_timeout=10,
    stop_timeout=1,
    lost_stop_timeout=0.5,
    refill_retry=2,
)


@dataclass
class Harness:
    clock: VirtualClock
    slurm: FakeSlurm
    server: FakeServer
    world: World
    launcher: FakeLauncher
    supervisor: Supervisor
    run_dir: Path
    #: the slurmd probe, when the test asked for one (``make(probe=True)``)
    probe: FakeProbe | None = None

    def run(self) -> RunResult:
        try:
            return self.supervisor.run()
        finally:
            self.supervisor.events.close()

    def events(self) -> list[ev.Event]:
        return ev.read_events(self.run_dir / ev.EVENTS_FILE)

    def kinds(self) -> list[str]:
        return [e.kind for e in self.events()]

    def of_kind(self, kind: str) -> list[ev.Event]:
        return [e for e in self.events() if e.kind == kind]

    def promotes(self) -> list[dict[str, Any]]:
        """The bodies of every PROMOTE sent, with the sender name they went to."""
        return [{"to": self._sender_of(s.peer), **s.message.body} for s in self.server.sent_of(msg.PROMOTE)]

    def stopped_senders(self) -> list[str]:
        return [self._sender_of(s.peer) for s in self.server.sent_of(msg.STOP)]

    def launches(self) -> list[tuple[str, str, int]]:
        """(node, role, epoch) of every step launched, in order."""
        return [(launch.node, launch.role, launch.epoch) for launch in self.slurm.launches]

    def status(self) -> JobStatus:
        return read_status(self.run_dir)

    @staticmethod
    def _sender_of(peer: bytes) -> str:
        return peer.decode().split("#")[0]


@pytest.fixture
def make(tmp_path: Path) -> Callable[..., Harness]:
    def build(
        *,
        active: int = 3,
        spares: int = 1,
        ntasks: int = 1,
        train_s: float | None = 8.0,
        config: SupervisorConfig = CONFIG,
        store: tuple[str, int] = ("", 0),
        recovery: str = "live",
        probe: bool = False,
        node_beats: bool = False,
        refill: bool = False,
    ) -> Harness:
        clock = VirtualClock()
        nodes = [f"c{i}" for i in range(1, active + spares + 1)]
        slurm = FakeSlurm(clock, nodes)
        server = FakeServer(clock)
        world = World(clock, server, slurm, train_s=train_s, node_beats=node_beats)
        launcher = FakeLauncher(slurm, clock, job_id=JOB_ID)
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        prober = FakeProbe(clock) if probe else None
        events = ev.EventLog(run_dir / ev.EVENTS_FILE, job=str(JOB_ID), clock=clock.time)
        supervisor = Supervisor(
            job_id=JOB_ID,
            run_dir=run_dir,
            membership=Membership.initial(nodes, active, ntasks),
            launcher=launcher,
            server=server,
            slurm=slurm,  # type: ignore[arg-type]
            events=events,
            config=config,
            clock=clock,
            store=store,
            recovery=recovery,
            probe=prober,
            refill=refill,
        )
        return Harness(clock, slurm, server, world, launcher, supervisor, run_dir, prober)

    return build


#: The rendezvous store of the live tests (as under ``tp run`` with torch on the batch host).
STORE = ("c1", 29400)
#: Long enough that every recovery in the live tests ends before the survivors finish training.
TRAIN_S = 20.0

Live = Callable[..., tuple[Harness, ElasticRanks]]


@pytest.fixture
def live(make: Callable[..., Harness]) -> Live:
    """``make``'s harness with a rendezvous store, ``recovery`` and elastic ranks on ``elastic`` nodes."""

    def build(
        *,
        recovery: str = "live",
        elastic: set[str] | None = None,
        active: int = 3,
        spares: int = 1,
        ntasks: int = 1,
        agreed_lag: int = 0,
        probe: bool = False,
        node_beats: bool = False,
        refill: bool = False,
        config: SupervisorConfig = CONFIG,
    ) -> tuple[Harness, ElasticRanks]:
        h = make(
            active=active,
            spares=spares,
            ntasks=ntasks,
            train_s=TRAIN_S,
            store=STORE,
            recovery=recovery,
            probe=probe,
            node_beats=node_beats,
            refill=refill,
            config=config,
        )
        return h, ElasticRanks(h.world, elastic, agreed_lag=agreed_lag)

    return build


def sent(h: Harness, kind: str) -> list[tuple[str, dict[str, Any]]]:
    """(sender it went to, body) of every message of ``kind`` the supervisor sent."""
    return [(h._sender_of(s.peer), s.message.body) for s in h.server.sent_of(kind)]


def at_of(h: Harness, event: ev.Event) -> float:
    """When an event happened, in virtual seconds from the start."""
    return event.ts - h.clock.WALL0
