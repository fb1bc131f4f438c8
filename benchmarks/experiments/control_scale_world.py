"""The simulated job of the control-plane scale benchmark: what both of its sides agree on.

:mod:`.control_scale` runs the real supervisor (:mod:`.control_scale_supervisor`) against
simulated node agents (:mod:`.control_scale_agents`). Both read this module: the row
(nodes, spares, per-node or per-rank beats, interval), the faults and when they strike
(:class:`Schedule`, one ``time.monotonic`` clock for every process of the host), how the
simulated training advances (:func:`step_at`, :func:`phase_at`) and the messages the
ranks send, signed as :func:`torchpass_slurm.control.messages.encode` signs them.

A simulated node is what ``rank/nodebeat.py`` makes of a node of 8 ranks: local rank 0
(the node's agent) holds the node's one control connection and sends, every interval,
one heartbeat for the node, its own beat plus ``"tasks": [[local_rank, rank, step, state,
age_ms, alive], ...]`` for the other 7, each rank's last beat to it and that beat's age.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from torchpass_slurm.control import messages
from torchpass_slurm.phase import Phase
from torchpass_slurm.strenum import StrEnum

RANKS_PER_NODE = 8
#: The heartbeat interval the ranks get by default (4 Hz).
INTERVAL_S = 0.25
#: One training step of the simulated job; its phase is COMPUTE for this share of it, then SYNC.
STEP_S = 0.5
COMPUTE_SHARE = 0.3
#: The local rank that a rank fault strikes.
VICTIM_LOCAL = 3
#: Until every step is up, the nodes beat at most this many messages a second in all, and at
#: least every :data:`RAMP_MAX_INTERVAL_S` (under the 1 s ``silence_threshold``), so that the
#: start, where every node's last hello costs an fsync'd ``worker_up`` event, does not bury
#: the loop in a backlog before the window.
RAMP_RATE = 2500.0
RAMP_MAX_INTERVAL_S = 0.9


class FaultKind(StrEnum):
    """What the benchmark breaks, one node each."""

    #: the node dies: its agent stops sending, and its slurmd stops answering
    NODE_STOPPED = "stopped node"
    #: one rank's process dies: its agent goes on beating and says so (``alive`` false, its entry ages)
    RANK_DIED = "dead rank"
    #: one rank stops beating while its process lives (``alive`` true, its entry ages)
    RANK_HUNG = "hung rank"
    #: the agent's process dies: its socket closes; the node, its slurmd and its step live on
    #: (today's step runs the node's 8 ranks: one task's death does not end it)
    AGENT_DIED = "dead agent"
    #: the same, and srun reports the step's end (an agent that is its step's only task)
    AGENT_STEP_ENDED = "dead agent, step ends"


#: When each fault strikes, in seconds after the fault phase begins (the measured window is
#: over by then: its numbers are those of a steady job). The benchmark plans recoveries but
#: does not carry them out, so a step it found lost stays in the job: the ended step goes
#: first, while every other step runs the elastic loop (that makes an exit conclusive, as in
#: a healthy job). The others are detected on their own node's evidence, apart enough that
#: no detection waits on another's (a hung rank and a silent agent take ``heartbeat_timeout``).
FAULT_OFFSETS_S = {
    FaultKind.AGENT_STEP_ENDED: 0.0,
    FaultKind.NODE_STOPPED: 1.0,
    FaultKind.RANK_DIED: 3.5,
    FaultKind.RANK_HUNG: 5.0,
    FaultKind.AGENT_DIED: 6.0,
}
#: How long after a fault its detection may come: ``silence_threshold`` and a probe, or
#: ``heartbeat_timeout``, each with slack. The row's faults are over once every one has had this.
DETECTION_ALLOWANCE_S = {
    FaultKind.AGENT_STEP_ENDED: 2.0,
    FaultKind.NODE_STOPPED: 3.0,
    FaultKind.RANK_DIED: 3.0,
    FaultKind.RANK_HUNG: 7.0,
    FaultKind.AGENT_DIED: 7.0,
}
#: Which node each fault strikes, as a share of the active nodes (apart from each other).
FAULT_NODES = {
    FaultKind.NODE_STOPPED: 0.50,
    FaultKind.RANK_DIED: 0.30,
    FaultKind.RANK_HUNG: 0.70,
    FaultKind.AGENT_DIED: 0.10,
    FaultKind.AGENT_STEP_ENDED: 0.90,
}
#: The exit status srun reports for a step whose one task was killed.
KILLED_STATUS = 137


@dataclass(frozen=True)
class Row:
    """One row: a job of ``nodes`` active nodes of 8 ranks and ``spares`` standby nodes."""

    name: str
    nodes: int
    spares: int = 0
    #: one heartbeat per node from its agent (``TORCHPASS_NODE_HEARTBEAT=1``), else one per rank
    per_node: bool = True
    interval_s: float = INTERVAL_S
    faults: tuple[FaultKind, ...] = tuple(FaultKind)

    @property
    def ranks(self) -> int:
        return self.nodes * RANKS_PER_NODE

    @property
    def senders(self) -> int:
        """Heartbeat senders: the active nodes' agents (or every rank), and every spare's ranks."""
        return (self.nodes if self.per_node else self.ranks) + self.spares * RANKS_PER_NODE

    @property
    def offered_rate(self) -> float:
        """Heartbeats per second the job sends."""
        return self.senders / self.interval_s


@dataclass(frozen=True)
class Injected:
    """One fault: what, on which node (its index) and rank, when (``time.monotonic``)."""

    kind: FaultKind
    node: int
    at: float
    local: int = VICTIM_LOCAL


@dataclass(frozen=True)
class Schedule:
    """The measurement, in ``time.monotonic`` seconds (one clock for every process of the host)."""

    #: the simulated training's step 0
    origin: float
    #: from then on every node beats at the row's interval (before: the ramp's)
    steady_from: float
    #: the measured window, without faults
    start: float
    end: float
    faults: tuple[Injected, ...] = ()

    @property
    def over(self) -> float:
        """When every fault has had its time to be detected (the window's end without faults)."""
        return max((f.at + DETECTION_ALLOWANCE_S[f.kind] for f in self.faults), default=self.end)

    def fault_of(self, node: int) -> Injected | None:
        return next((f for f in self.faults if f.node == node), None)


def fault_plan(row: Row, begin: float) -> tuple[Injected, ...]:
    """The row's faults, each on its own node, from ``begin`` on (:data:`FAULT_OFFSETS_S`)."""
    out: list[Injected] = []
    for kind in row.faults:
        node = min(row.nodes - 1, round(FAULT_NODES[kind] * row.nodes))
        while any(f.node == node for f in out):
            node = (node + 1) % row.nodes
        out.append(Injected(kind, node, begin + FAULT_OFFSETS_S[kind]))
    return tuple(out)


def ramp_interval(row: Row) -> float:
    """The nodes' beat interval until every step is up (:data:`RAMP_RATE`)."""
    return max(row.interval_s, min(RAMP_MAX_INTERVAL_S, row.senders / RAMP_RATE))


def node_name(index: int) -> str:
    return f"n{index:05d}"


def node_index(name: str) -> int:
    return int(name[1:])


# --- the simulated training -------------------------------------------------------------------


def step_at(t: float, origin: float) -> int:
    """The committed step of every rank at ``t``: one every :data:`STEP_S`."""
    return max(0, int((t - origin) / STEP_S))


def phase_at(t: float, origin: float) -> str:
    """Where in its step a rank is at ``t``: computing, then in the gradients' all-reduce."""
    return Phase.COMPUTE if (t - origin) % STEP_S < COMPUTE_SHARE * STEP_S else Phase.SYNC


def last_local_beat(t: float, origin: float, local: int, interval: float) -> float:
    """When local rank ``local`` last beat to its agent before ``t``: the ranks of a node beat
    at their own phase of the interval (``local`` eighths of it after local rank 0)."""
    offset = local * interval / RANKS_PER_NODE
    return t - (t - origin - offset) % interval


# --- the messages -------------------------------------------------------------------------------


def node_beat_body(
    base: int, t: float, origin: float, interval: float, stopped: Injected | None = None
) -> dict[str, Any]:
    """The heartbeat a node's agent (local rank 0 of ranks ``base`` .. ``base+7``) sends at
    ``t``: its own beat and each other rank's last one, as ``BeatCollector.periodic`` builds
    it. A rank struck by ``stopped`` (dead or hung) keeps the entry of its last beat before
    it, older every beat; ``alive`` says whether its process lives."""
    tasks = []
    for local in range(1, RANKS_PER_NODE):
        heard, alive = last_local_beat(t, origin, local, interval), True
        if stopped is not None and stopped.local == local and t >= stopped.at:
            heard = last_local_beat(stopped.at, origin, local, interval)
            alive = stopped.kind != FaultKind.RANK_DIED
        age_ms = int((t - heard) * 1000)
        tasks.append([local, base + local, step_at(heard, origin), phase_at(heard, origin), age_ms, alive])
    body = rank_beat_body(base, t, origin)
    body["tasks"] = tasks
    return body


def rank_beat_body(rank: int, t: float, origin: float) -> dict[str, Any]:
    """One rank's own heartbeat (``Runtime._beat_body``)."""
    return {"rank": rank, "step": step_at(t, origin), "state": phase_at(t, origin)}


def standby_beat_body() -> dict[str, Any]:
    """A spare's rank, waiting for its promotion (``wait_for_promotion``)."""
    return {"rank": None, "step": None, "state": Phase.STANDBY}


def sign(secret: bytes, kind: str, sender: str, seq: int, ts: float, body: dict[str, Any]) -> list[bytes]:
    """The frames :func:`messages.encode` makes, without its checks of our own input.

    Half its cost: the load generators share the supervisor's cores. Byte-identical to
    ``encode`` (a unit test, and each generator's first message of every kind, check it).
    """
    envelope = {"body": body, "kind": kind, "sender": sender, "seq": seq, "to": messages.SUPERVISOR, "ts": ts}
    payload = json.dumps(
        envelope, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")
    return [messages.PROTOCOL_VERSION, payload, messages._mac(secret, messages.PROTOCOL_VERSION, payload)]
