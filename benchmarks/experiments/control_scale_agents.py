"""The simulated node agents of the control-plane scale benchmark: the load-generator processes.

Each process owns some of the job's nodes (every ``count``-th): one ZeroMQ DEALER per node
(a CURVE client of the job's keys, as ``ControlClient`` makes it), all in one context. A
node first greets, as its ranks do once up: an active node's 8 ranks each say ``hello``
(with the launch's epoch) and ``live_ready`` (they run the elastic loop); a spare's 8 ranks
say ``standby``. Then it beats every interval, at its own phase: an active node's agent
sends the node's heartbeat (:func:`~.control_scale_world.node_beat_body`), or with per-rank
beats each rank its own; a spare's ranks beat ``standby``, each its own (as
``wait_for_promotion`` does). A beat more than an interval late is skipped, never sent in a
burst with the next (a heartbeat thread waits an interval after each beat).

The faults of the :class:`~.control_scale_world.Schedule` strike here: a stopped node stops
sending, a dead agent closes its socket, a dead or hung rank's entry ages in its node's beat.
"""

from __future__ import annotations

import heapq
import os
import resource
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import zmq

from torchpass_slurm.control import messages
from torchpass_slurm.control.client import configure_socket
from torchpass_slurm.control.kinds import Kind, ReportKind
from torchpass_slurm.control.security import derive_keys, make_curve_client, raise_fd_limit

from .control_scale_world import (
    RANKS_PER_NODE,
    FaultKind,
    Injected,
    Row,
    Schedule,
    node_beat_body,
    node_name,
    ramp_interval,
    rank_beat_body,
    sign,
    standby_beat_body,
)

#: Sockets connected at once, and the pause between two waves: the server's gate sheds the
#: oldest of more than 256 connections in their handshake (``SocketLimits.max_pending``).
WAVE = 64
WAVE_PAUSE_S = 0.05
#: The greetings (hello and live_ready of every rank) are spread over at least an interval,
#: at most this many messages a second in all: each node's last hello costs the supervisor an
#: fsync'd ``worker_up`` event (about 3 ms here), and the greeted nodes beat meanwhile.
GREET_RATE = 1500.0


@dataclass
class Agent:
    """One simulated node: its agent's socket, its ranks, what has struck it."""

    index: int
    spare: bool
    #: its first rank (active nodes)
    base: int
    sock: zmq.Socket[bytes] | None
    greeted: bool = False
    fault: Injected | None = None
    #: the last beat it sent (``time.monotonic``)
    last_sent: float | None = None

    @property
    def name(self) -> str:
        return node_name(self.index)


class Agents:
    """The nodes of one load generator; see the module docstring."""

    def __init__(self, endpoint: str, secret: bytes, row: Row, index: int, count: int) -> None:
        self.secret, self.row = secret, row
        total = row.nodes + row.spares
        self.agents = [Agent(i, i >= row.nodes, i * RANKS_PER_NODE, None) for i in range(index, total, count)]
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.ctx.set(zmq.MAX_SOCKETS, len(self.agents) + 64)
        self.keys = derive_keys(secret)
        self.endpoint = endpoint
        self.seq = messages.SequenceCounter()
        self.sent = self.refused = self.skipped = 0
        self.lateness = 0.0
        self.schedule: Schedule | None = None
        self._checked: set[str] = set()

    def connect(self) -> None:
        """One DEALER per node, connected in waves."""
        for k, agent in enumerate(self.agents):
            sock = self.ctx.socket(zmq.DEALER)
            configure_socket(sock)
            make_curve_client(sock, self.keys)
            sock.connect(self.endpoint)
            agent.sock = sock
            if k % WAVE == WAVE - 1:
                time.sleep(WAVE_PAUSE_S)

    def greet_spread(self) -> float:
        """How long the greetings of every node take (the whole job's, at :data:`GREET_RATE`)."""
        greetings = (self.row.nodes * 2 + self.row.spares) * RANKS_PER_NODE
        return max(self.row.interval_s, greetings / GREET_RATE)

    def run(self, conn: Connection, origin: float) -> None:
        """Greet, then beat at the ramp's interval, from ``origin`` on, until ``conn`` says "end".
        ``conn`` sends the :class:`Schedule` once every step is up: its faults, and the time
        from which every node beats at the row's interval, each at its own phase."""
        total, interval = self.row.nodes + self.row.spares, ramp_interval(self.row)
        due = [(origin + a.index / total * self.greet_spread(), k) for k, a in enumerate(self.agents)]
        heapq.heapify(due)
        turns = 0
        while due:
            at, k = due[0]
            wait, turns = at - time.monotonic(), turns + 1
            # sleeps, but an order wakes it; when behind, it looks for one every 256 turns
            if conn.poll(wait) if wait > 0.001 else (turns % 256 == 0 and conn.poll(0)):
                order = conn.recv()
                if order == "end":
                    return
                self.strike(order)
                interval = self.row.interval_s
                due = [(order.steady_from + a.index / total * interval, k) for k, a in enumerate(self.agents)]
                heapq.heapify(due)
                continue
            heapq.heapreplace(due, (at + interval, k))
            if -wait > interval and self.agents[k].greeted:
                self.skipped += 1
                continue
            self.lateness = max(self.lateness, -wait)
            self.act(self.agents[k], at, origin)

    def strike(self, schedule: Schedule) -> None:
        self.schedule = schedule
        for agent in self.agents:
            agent.fault = schedule.fault_of(agent.index)

    def act(self, agent: Agent, t: float, origin: float) -> None:
        """The node's turn at ``t``: its greeting, or its beat (or nothing, once struck)."""
        fault = agent.fault
        if agent.sock is None:
            return
        if fault is not None and t >= fault.at:
            if fault.kind == FaultKind.NODE_STOPPED:
                return
            if fault.kind in (FaultKind.AGENT_DIED, FaultKind.AGENT_STEP_ENDED):
                agent.sock.close(linger=0)  # the process is gone: the kernel closes its connection
                agent.sock = None
                return
        if not agent.greeted:
            agent.greeted = True
            for kind, sender, body in self.greetings(agent):
                self.send(agent, kind, sender, body)
            return
        for sender, body in self.beats(agent, t, origin):
            self.send(agent, Kind.HEARTBEAT, sender, body)
        agent.last_sent = t

    def greetings(self, agent: Agent) -> list[tuple[str, str, dict[str, Any]]]:
        out: list[tuple[str, str, dict[str, Any]]] = []
        pid = os.getpid()
        for local in range(RANKS_PER_NODE):
            sender = f"{agent.name}/{local}"
            if agent.spare:
                out.append((Kind.STANDBY, sender, {"node": agent.name, "local_rank": local, "pid": pid}))
                continue
            rank = agent.base + local
            hello = {"node": agent.name, "rank": rank, "local_rank": local, "role": "active", "pid": pid}
            out.append((Kind.HELLO, sender, {**hello, "epoch": 0}))
            ready = {"event": str(ReportKind.LIVE_READY), "fields": {"rank": rank, "step": 0}}
            out.append((Kind.REPORT, sender, ready))
        return out

    def beats(self, agent: Agent, t: float, origin: float) -> list[tuple[str, dict[str, Any]]]:
        if agent.spare:
            return [(f"{agent.name}/{local}", standby_beat_body()) for local in range(RANKS_PER_NODE)]
        if self.row.per_node:
            body = node_beat_body(agent.base, t, origin, self.row.interval_s, agent.fault)
            return [(f"{agent.name}/0", body)]
        fault = agent.fault  # per-rank beats: a dead or hung rank's own beats stop
        stopped = fault.local if fault is not None and t >= fault.at else None
        return [
            (f"{agent.name}/{local}", rank_beat_body(agent.base + local, t, origin))
            for local in range(RANKS_PER_NODE)
            if local != stopped
        ]

    def send(self, agent: Agent, kind: str, sender: str, body: dict[str, Any]) -> None:
        assert agent.sock is not None
        ts, seq = time.time(), self.seq.next()
        frames = sign(self.secret, kind, sender, seq, ts, body)
        if kind not in self._checked:
            msg = messages.Message(kind, sender, seq, ts, body)
            assert frames == messages.encode(msg, self.secret), "sign() no longer matches messages.encode()"
            self._checked.add(kind)
        try:
            agent.sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.refused += 1
            return
        self.sent += 1

    def close(self) -> None:
        for agent in self.agents:
            if agent.sock is not None:
                agent.sock.close(linger=0)
        self.ctx.term()


def agents_main(conn: Connection, endpoint: str, secret: bytes, row: Row, index: int, count: int) -> None:
    """A load generator process: connect, say "ready", greet and beat from the origin it is
    sent, report its numbers once told "end"."""
    raise_fd_limit()
    agents = Agents(endpoint, secret, row, index, count)
    agents.connect()
    conn.send("ready")
    origin = conn.recv()
    usage0, wall0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    agents.run(conn, origin)
    usage, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - wall0
    cpu = usage.ru_utime + usage.ru_stime - usage0.ru_utime - usage0.ru_stime
    agents.close()
    conn.send(
        {
            "cpu_share": cpu / wall,
            "sent": agents.sent,
            "refused": agents.refused,
            "skipped": agents.skipped,
            "lateness_s": agents.lateness,
            "last_sent": {a.index: a.last_sent for a in agents.agents if a.fault is not None},
        }
    )
