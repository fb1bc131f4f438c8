"""Control-plane scale: thousands of simulated ranks heartbeating into one real ControlServer.

    python -m benchmarks.experiments.control_scale            # 2,048 nodes x 8 ranks (~2.5 min)
    python -m benchmarks.experiments.control_scale --quick    # 256 nodes x 8 ranks: it works (~30 s)
    python -m benchmarks.experiments.control_scale --profile  # cProfile the first scenario's supervisor

The supervisor process runs the real :class:`~torchpass_slurm.control.server.ControlServer`
(ZeroMQ ROUTER on 127.0.0.1, HMAC-checked decode, replay guard) and the
per-message bookkeeping of ``Supervisor._pump`` (``WorkerStep.seen``: a dict
of last-heard times per sender), reimplemented here in :class:`NodeBeats` so
that nothing of ``supervisor/`` is imported. After every loop pass (or, in the
paced rows, at most every :data:`CHECK_PACE_S`) it runs the silence check of
``Detectors._silence`` with a threshold of :data:`THRESHOLD_S`.

A few load-generator processes own the simulated ranks: one ZeroMQ DEALER
socket per rank (per node in the aggregated rows), all in one context per
process, signed with :func:`torchpass_slurm.control.messages.encode`. Beats are
spread evenly over the interval. Once the supervisor has heard every sender,
it measures a window: its process CPU time over wall time (the zmq I/O
thread included; the main thread alone with ``time.thread_time``), messages
accepted, the delay from a beat's timestamp to its receipt, and how long it
took to notice one rank (or node) that stopped at a known time.

Rows (each its own supervisor, measured one after the other in one run):
per-rank beats from every rank; per-node heartbeats as ``rank/nodebeat.py``
sends them (local rank 0 sends one heartbeat for its node's 8 ranks: its own
beat and ``"tasks": [[local_rank, rank, step, state, age_ms], ...]`` for the
other 7, which ``messages.decode`` checks entry by entry); each with the
silence check on every pass and paced; a 2,048-rank baseline; today's 2 s
interval.

This is a script, not a test: numbers depend on the machine; never assert on them.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import multiprocessing as mp
import os
import platform
import pstats
import resource
import secrets
import sys
import time
import timeit
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import zmq

from torchpass_slurm.control import messages
from torchpass_slurm.control.client import configure_socket
from torchpass_slurm.control.kinds import Kind
from torchpass_slurm.control.security import derive_keys, make_curve_client
from torchpass_slurm.control.server import ControlServer

#: The heartbeat interval the ranks will get by default (4 Hz).
INTERVAL_S = 0.25
#: Silence past this is a lost rank (the benchmark's threshold).
THRESHOLD_S = 1.0
RANKS_PER_NODE = 8
#: The supervisor's loop: ``server.poll`` waits at most this long (``POLL_SLICE``).
POLL_SLICE = timedelta(seconds=0.5)
#: The paced rows run the silence check at most this often.
CHECK_PACE_S = 0.1
#: Most sockets one load generator owns (each is a TCP connection and an eventfd).
SOCKETS_PER_GENERATOR = 8192
#: Until every sender is heard, all of them together send about this many beats per second
#: (at most one per sender per row interval): 16,384 connections come up in seconds, not
#: under a load the supervisor cannot take.
RAMP_RATE = 8000.0
#: The supervisor measures once it has heard every sender and this much more has passed.
SETTLE_S = 1.0
#: Longest wait for every sender's first beat (16,384 connections on loopback take seconds).
CONNECT_TIMEOUT_S = 60.0
#: Longest wait for a process of the benchmark to start, answer or finish.
PROCESS_TIMEOUT_S = 60.0
#: A one-core budget the control plane should stay under (share of one core).
BUDGET = 0.05


@dataclass(frozen=True)
class Scenario:
    """One row: how many nodes, how they beat, how often the silence check runs."""

    name: str
    nodes: int
    #: one heartbeat per node (local rank 0 carries its 8 ranks) instead of one per rank
    aggregate: bool = False
    interval_s: float = INTERVAL_S
    #: None: the silence check runs after every loop pass, as the supervisor's does
    check_pace_s: float | None = None
    threshold_s: float = THRESHOLD_S
    #: one rank (one node when aggregated) stops in the window
    victim: bool = True

    @property
    def ranks(self) -> int:
        return self.nodes * RANKS_PER_NODE

    @property
    def senders(self) -> int:
        """Sockets, and distinct senders: one per rank, or one per node when aggregated."""
        return self.nodes if self.aggregate else self.ranks

    @property
    def offered_rate(self) -> float:
        """Messages per second the ranks send."""
        return self.senders / self.interval_s


@dataclass(frozen=True)
class Sizing:
    """How long each row measures."""

    window_s: float = 6.0
    #: the victim stops this far into the window
    stop_after_s: float = 2.0
    #: the loop runs on this long after the window, for a late detection
    tail_s: float = 2.0


def scenarios(nodes: int) -> list[Scenario]:
    """The rows for ``nodes`` nodes of 8 ranks, and a baseline an eighth the size."""
    ranks, small = nodes * RANKS_PER_NODE, max(nodes // 8, 1)
    return [
        Scenario(f"per-rank, {ranks:,} ranks", nodes),
        Scenario(f"per-rank, {ranks:,} ranks, check paced", nodes, check_pace_s=CHECK_PACE_S),
        Scenario(f"per-node, {nodes:,} nodes x 8", nodes, aggregate=True),
        Scenario(
            f"per-node, {nodes:,} nodes x 8, check paced", nodes, aggregate=True, check_pace_s=CHECK_PACE_S
        ),
        Scenario(f"baseline: per-rank, {small * RANKS_PER_NODE:,} ranks", small),
        Scenario(
            f"per-rank, {ranks:,} ranks, 2 s interval (today), check paced",
            nodes,
            interval_s=2.0,
            check_pace_s=CHECK_PACE_S,
            threshold_s=8.0,
            victim=False,
        ),
    ]


# --- the simulated ranks ----------------------------------------------------------------------


def node_name(index: int) -> str:
    return f"n{index:05d}"


@dataclass(frozen=True)
class Beat:
    """One sender of heartbeats: a rank (``ranks`` = its own), or a node's local rank 0 for all 8."""

    sender: str
    ranks: tuple[int, ...]
    #: when in the interval it beats (a fraction of the interval after the cycle's start)
    phase: float


def beats_of(scenario: Scenario) -> list[Beat]:
    """Every sender, with its phase: evenly spread over one interval."""
    out = []
    for i in range(scenario.senders):
        phase = i / scenario.senders
        if scenario.aggregate:
            base = i * RANKS_PER_NODE
            out.append(Beat(f"{node_name(i)}/0", tuple(range(base, base + RANKS_PER_NODE)), phase))
        else:
            node, local = divmod(i, RANKS_PER_NODE)
            out.append(Beat(f"{node_name(node)}/{local}", (i,), phase))
    return out


def victim_of(scenario: Scenario) -> int:
    """Index (in :func:`beats_of`) of the sender that stops: local rank 3, or the node, in the middle."""
    middle = scenario.nodes // 2
    return middle if scenario.aggregate else middle * RANKS_PER_NODE + 3


def relayed_age_ms(local: int) -> int:
    """The age a node beat gives local rank ``local``'s last beat: the node's beats are spread
    over the interval, so the ages are too (0 to 7/8 of an interval)."""
    return round(INTERVAL_S * 1000 * local / RANKS_PER_NODE)


def heartbeat_body(beat: Beat, step: int) -> dict[str, Any]:
    """The body a rank's heartbeat thread sends (``Runtime._beat_body``); for a node, local rank 0's
    (``rank/nodebeat.py`` ``BeatCollector``): its own beat and every other rank's, with its age."""
    body: dict[str, Any] = {"rank": beat.ranks[0], "step": step, "state": "running"}
    if len(beat.ranks) > 1:
        body["tasks"] = [
            [local, rank, step, "running", relayed_age_ms(local)]
            for local, rank in enumerate(beat.ranks)
            if local > 0
        ]
    return body


def generator_count(scenario: Scenario) -> int:
    return max(2, -(-scenario.senders // SOCKETS_PER_GENERATOR))


def ramp_interval(scenario: Scenario) -> float:
    """Each sender's interval until every sender has been heard (:data:`RAMP_RATE`)."""
    return max(scenario.interval_s, scenario.senders / RAMP_RATE)


def sign(secret: bytes, sender: str, seq: int, ts: float, body: dict[str, Any]) -> list[bytes]:
    """The frames :func:`messages.encode` makes for this heartbeat, without its checks of our own input.

    Half its cost: the load generators share the supervisor's two cores.
    Byte-identical to ``encode`` (a unit test and every generator's first beat check it).
    """
    envelope = {"body": body, "kind": "heartbeat", "sender": sender, "seq": seq, "ts": ts}
    envelope["to"] = messages.SUPERVISOR
    payload = json.dumps(
        envelope, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")
    return [messages.PROTOCOL_VERSION, payload, messages._mac(secret, messages.PROTOCOL_VERSION, payload)]


# --- the supervisor's bookkeeping (supervisor/workers.py WorkerStep, detect.py _silence) -------


@dataclass
class NodeBeats:
    """What the supervisor keeps per node's step: last-heard time per task, highest step."""

    ntasks: int
    state: str = "running"
    #: control-plane sender (``NODE/LOCAL``, relayed ones too) -> last heard
    heartbeats: dict[str, float] = field(default_factory=dict)
    #: sender -> (step, phase) of its last beat
    phases: dict[str, tuple[int | None, str]] = field(default_factory=dict)
    last_step: int | None = None

    def seen(self, key: str, now: float, step: int | None = None, phase: str | None = None) -> None:
        self.heartbeats[key] = now
        if phase is not None:
            self.phases[key] = (step, phase)
        if step is not None and (self.last_step is None or step > self.last_step):
            self.last_step = step

    def relayed(self, relay: str, tasks: list[list[Any]], now: float) -> None:
        """``WorkerStep.relayed``: each entry heard ``age_ms`` before ``now``, unless newer news."""
        node, _, own = relay.rpartition("/")
        for local, _rank, step, phase, age_ms in tasks:
            if local >= self.ntasks or str(local) == own:
                continue
            sender, heard = f"{node}/{local}", now - age_ms / 1000
            if heard >= self.heartbeats.get(sender, heard):
                self.seen(sender, heard, step, phase)

    def silent_for(self, now: float) -> float | None:
        """Seconds since the stalest task was heard from (None: not all heard yet)."""
        if len(self.heartbeats) < self.ntasks:
            return None
        return now - min(self.heartbeats.values())


def on_message(steps: dict[str, NodeBeats], sender: str, body: Any, now: float) -> None:
    """One heartbeat into the bookkeeping, as ``Supervisor._pump`` and ``_on_message`` do it."""
    step = steps.get(sender.rsplit("/", 1)[0])
    if step is None:
        return
    step.seen(sender, now, body.get("step"), body.get("state"))
    if "tasks" in body:  # a per-node heartbeat: its node's other ranks, relayed
        step.relayed(sender, body["tasks"], now)


def silent_nodes(steps: dict[str, NodeBeats], now: float, threshold: float) -> list[str]:
    """Every node with a task silent past ``threshold`` (``_silence`` stops at the first)."""
    out = []
    for node, step in steps.items():
        if step.state == "running":
            silent = step.silent_for(now)
            if silent is not None and silent > threshold:
                out.append(node)
    return out


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# --- the supervisor process --------------------------------------------------------------------


def raise_fd_limit() -> int:
    """The soft limit on open files raised to the hard one; returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


@dataclass(frozen=True)
class Schedule:
    """The measurement, in ``time.monotonic`` seconds (one clock for every process of this host)."""

    #: the generators switch from the ramp to the row's interval
    origin: float
    start: float
    stop: float
    end: float


Snapshot = tuple[float, float, float, int, int, float]


class SupervisorLoop:
    """The supervisor's side of one row: serve, keep the books, check for silence, measure."""

    def __init__(self, server: ControlServer, scenario: Scenario, profile: bool) -> None:
        self.server, self.scenario = server, scenario
        self.steps = {node_name(n): NodeBeats(RANKS_PER_NODE) for n in range(scenario.nodes)}
        self.senders: set[str] = set()
        self.accepted = self.passes = 0
        self.check_s = 0.0
        self.next_check = 0.0
        self.latencies: list[float] = []
        #: nodes silent at the last check, and every (node, wall time) it went silent at
        self.silent: set[str] = set()
        self.went_silent: list[tuple[str, float]] = []
        self.start: Snapshot | None = None
        self.end: Snapshot | None = None
        self.end_wall = float("inf")
        # the main thread's CPU time, not wall time: the host's other load is not the loop's
        self.profiler = cProfile.Profile(time.thread_time) if profile else None

    def run(self, conn: Connection, sizing: Sizing) -> None:
        """Until every sender is heard (then tell ``conn``), then through the schedule ``conn`` sends."""
        began = time.monotonic()
        while len(self.senders) < self.scenario.senders and time.monotonic() - began < CONNECT_TIMEOUT_S:
            self.senders.update(msg.sender for _peer, msg in self.one_pass())
        conn.send({"heard": len(self.senders), "after_s": time.monotonic() - began})
        while not conn.poll(0):
            self.one_pass()
        schedule: Schedule = conn.recv()
        while (mono := time.monotonic()) < schedule.end + sizing.tail_s:
            self.one_pass()
            if self.start is None and mono >= schedule.start:
                self.start = self.snapshot()
                self.went_silent.clear()  # silences of the ramp are not the row's
                if self.profiler is not None:
                    self.profiler.enable()
            elif self.start is not None and self.end is None and mono >= schedule.end:
                self.end, self.end_wall = self.snapshot(), time.time()
                if self.profiler is not None:
                    self.profiler.disable()

    def one_pass(self) -> list[tuple[bytes, messages.Message]]:
        """One pass of ``Supervisor.run``'s loop, as far as the control plane goes."""
        now = time.time()  # as Supervisor._pump: one time per pass, taken before the wait
        batch = self.server.poll(POLL_SLICE)
        received = time.time()
        sample = self.start is not None and self.end is None
        for _peer, msg in batch:
            on_message(self.steps, msg.sender, msg.body, now)
            self.accepted += 1
            if sample and self.accepted % 16 == 0:
                self.latencies.append(received - msg.ts)
        self.passes += 1
        mono = time.monotonic()
        if self.scenario.check_pace_s is None or mono >= self.next_check:
            began = time.perf_counter()
            silent = silent_nodes(self.steps, time.time(), self.scenario.threshold_s)
            self.check_s += time.perf_counter() - began
            self.next_check = mono + (self.scenario.check_pace_s or 0.0)
            if silent or self.silent:
                now = time.time()
                self.went_silent += [(node, now) for node in silent if node not in self.silent]
                self.silent = set(silent)
        return batch

    def snapshot(self) -> Snapshot:
        return (
            time.monotonic(),
            time.process_time(),
            time.thread_time(),
            self.accepted,
            self.passes,
            self.check_s,
        )

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {"heard": len(self.senders), "rejected": self.server.rejected}
        if self.start is not None and self.end is not None:
            wall, cpu, thread, accepted, passes, check = (
                b - a for a, b in zip(self.start, self.end, strict=True)
            )
            out.update(
                wall_s=wall,
                cpu_share=cpu / wall,
                main_thread_share=thread / wall,
                rate=accepted / wall,
                cpu_us_per_msg=cpu / accepted * 1e6 if accepted else None,
                passes_per_s=passes / wall,
                check_share=check / wall,
            )
        out["latency_ms"] = {
            "p50": _ms(percentile(self.latencies, 0.5)),
            "p99": _ms(percentile(self.latencies, 0.99)),
            "max": _ms(max(self.latencies, default=None)),
        }
        out["went_silent"] = self.went_silent
        out["end_wall"] = self.end_wall
        if self.profiler is not None:
            text = io.StringIO()
            pstats.Stats(self.profiler, stream=text).sort_stats("tottime").print_stats(14)
            out["profile"] = text.getvalue()
        return out


def supervisor_main(
    conn: Connection, secret: bytes, scenario: Scenario, sizing: Sizing, profile: bool
) -> None:
    """The supervisor process: a real ControlServer on loopback, the loop, the results to ``conn``."""
    raise_fd_limit()
    logging.getLogger("torchpass_slurm").setLevel(logging.ERROR)  # stale beats are counted, not logged
    server = ControlServer(secret, "127.0.0.1", 0)
    conn.send(server.endpoint)
    loop = SupervisorLoop(server, scenario, profile)
    loop.run(conn, sizing)
    result = loop.result()
    server.close()
    conn.send(result)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


# --- a load generator process ------------------------------------------------------------------


class Generator:
    """Some of the simulated ranks: one DEALER each, beats at their phase of the interval."""

    def __init__(self, endpoint: str, secret: bytes, scenario: Scenario, index: int, count: int) -> None:
        self.secret, self.scenario = secret, scenario
        everyone = beats_of(scenario)
        self.victim = everyone[victim_of(scenario)]
        self.mine = everyone[index::count]
        self.ctx = zmq.Context()
        self.ctx.set(zmq.MAX_SOCKETS, len(self.mine) + 64)
        self.sockets = []
        keys = derive_keys(secret)
        for _ in self.mine:
            sock = self.ctx.socket(zmq.DEALER)
            configure_socket(sock)
            make_curve_client(sock, keys)
            sock.connect(endpoint)
            self.sockets.append(sock)
        self.seq = messages.SequenceCounter()
        self.stop_at = float("inf")
        self.victim_ts: float | None = None
        self.sent = self.refused = self.skipped = 0
        self.lateness = 0.0
        self._checked = False

    def run(self, conn: Connection, origin: float, interval: float) -> None:
        """Beat from ``origin`` on, until ``conn`` says "end".

        ``conn`` may send a :class:`Schedule`: from its origin on, the row's
        interval. A beat more than an interval late is skipped, not sent in a
        burst with the next (a rank's heartbeat thread waits an interval after
        each beat).
        """
        cycle, i, n = 0, 0, len(self.mine)
        while True:
            due = origin + (cycle + self.mine[i].phase) * interval
            wait = due - time.monotonic()
            # sleeps, but an order wakes it; when behind, look for one every 256 beats
            if conn.poll(wait) if wait > 0.001 else (i % 256 == 0 and conn.poll(0)):
                order = conn.recv()
                if order == "end":
                    return
                origin, interval, self.stop_at = order.origin, self.scenario.interval_s, order.stop
                cycle, i, self.lateness, self.skipped = 0, 0, 0.0, 0
                continue
            if -wait > interval:
                self.skipped += 1
            else:
                self.lateness = max(self.lateness, -wait)
                self.beat(i, origin)
            i += 1
            if i == n:
                i, cycle = 0, cycle + 1

    def beat(self, i: int, origin: float) -> None:
        beat = self.mine[i]
        if beat is self.victim and self.scenario.victim and time.monotonic() >= self.stop_at:
            return  # the victim has stopped
        ts = time.time()
        body = heartbeat_body(beat, int((time.monotonic() - origin) * 2))
        seq = self.seq.next()
        frames = sign(self.secret, beat.sender, seq, ts, body)
        if not self._checked:
            msg = messages.Message(Kind.HEARTBEAT, beat.sender, seq, ts, body)
            assert frames == messages.encode(msg, self.secret), "sign() no longer matches messages.encode()"
            self._checked = True
        try:
            self.sockets[i].send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.refused += 1
            return
        self.sent += 1
        if beat is self.victim:
            self.victim_ts = ts

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        self.ctx.term()


def generator_main(
    conn: Connection, endpoint: str, secret: bytes, scenario: Scenario, index: int, count: int
) -> None:
    """A load generator process: the ramp's interval until told the row's schedule."""
    raise_fd_limit()
    gen = Generator(endpoint, secret, scenario, index, count)
    conn.send("ready")
    origin = conn.recv()
    usage0, wall0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    gen.run(conn, origin, ramp_interval(scenario))
    usage, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - wall0
    cpu = usage.ru_utime + usage.ru_stime - usage0.ru_utime - usage0.ru_stime
    gen.close()
    conn.send(
        {
            "cpu_share": cpu / wall,
            "sent": gen.sent,
            "refused": gen.refused,
            "skipped": gen.skipped,
            "lateness_s": gen.lateness,
            "victim_ts": gen.victim_ts,
        }
    )


# --- one row -----------------------------------------------------------------------------------


def receive(conn: Connection, timeout_s: float, what: str) -> Any:
    """The next object on ``conn``, or SystemExit after ``timeout_s`` naming what did not come."""
    if not conn.poll(timeout_s):
        sys.exit(f"control_scale: no {what} within {timeout_s:g} s (a process died or hangs; see above)")
    try:
        return conn.recv()
    except (EOFError, ConnectionError):
        sys.exit(f"control_scale: the process that was to send {what} has died (its traceback is above)")


def run_scenario(scenario: Scenario, sizing: Sizing, profile: bool = False) -> dict[str, Any]:
    """One row: a supervisor process, its load generators, the schedule, the results."""
    ctx = mp.get_context("spawn")
    secret = secrets.token_bytes(32)
    sup_conn, child = ctx.Pipe()
    procs = [
        ctx.Process(target=supervisor_main, args=(child, secret, scenario, sizing, profile), daemon=True)
    ]
    procs[0].start()
    try:
        endpoint = receive(sup_conn, PROCESS_TIMEOUT_S, "endpoint from the supervisor process")
        count = generator_count(scenario)
        conns = []
        for g in range(count):
            parent, child = ctx.Pipe()
            procs.append(
                ctx.Process(
                    target=generator_main, args=(child, endpoint, secret, scenario, g, count), daemon=True
                )
            )
            procs[-1].start()
            conns.append(parent)
        for c in conns:
            receive(c, PROCESS_TIMEOUT_S, "ready from a load generator")  # sockets made, connecting
        for c in conns:
            c.send(time.monotonic() + 0.1)
        heard = receive(sup_conn, CONNECT_TIMEOUT_S + PROCESS_TIMEOUT_S, "first beats from every sender")
        origin = time.monotonic() + 0.2
        start = origin + SETTLE_S
        schedule = Schedule(origin, start, start + sizing.stop_after_s, start + sizing.window_s)
        for c in [*conns, sup_conn]:
            c.send(schedule)
        result = receive(
            sup_conn, sizing.window_s + sizing.tail_s + PROCESS_TIMEOUT_S, "supervisor's results"
        )
        for c in conns:
            c.send("end")
        gens = [receive(c, PROCESS_TIMEOUT_S, "a load generator's results") for c in conns]
        for proc in procs:
            proc.join(timeout=PROCESS_TIMEOUT_S)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
    return summarise(scenario, heard, result, gens)


def summarise(
    scenario: Scenario, heard: dict[str, Any], result: dict[str, Any], gens: list[dict[str, Any]]
) -> dict[str, Any]:
    """One row's JSON: the supervisor's numbers, the victim's detection, the generators' load."""
    victim_node = beats_of(scenario)[victim_of(scenario)].sender.rsplit("/", 1)[0]
    victim_ts = next((g["victim_ts"] for g in gens if g["victim_ts"] is not None), None)
    found, false = detection(result.pop("went_silent"), victim_node, victim_ts, result.pop("end_wall"))
    return {
        "scenario": asdict(scenario),
        "ranks": scenario.ranks,
        "sockets": scenario.senders,
        "offered_rate": scenario.offered_rate,
        "connect_s": round(heard["after_s"], 2),
        **result,
        "detection_s": found,
        "false_silences": false,
        "generators": {
            "processes": len(gens),
            "cpu_share": sum(g["cpu_share"] for g in gens),
            "refused": sum(g["refused"] for g in gens),
            "skipped": sum(g["skipped"] for g in gens),
            "max_lateness_s": max(g["lateness_s"] for g in gens),
        },
    }


def detection(
    went_silent: list[tuple[str, float]], victim: str, victim_ts: float | None, window_end: float
) -> tuple[float | None, int]:
    """Seconds from the victim's last beat to the check that found its node silent, and the false silences.

    A false silence is a node that went silent within the window without
    having stopped: any node but the victim's, or the victim's before its
    last beat (the nodes, counted once each).
    """
    found = None
    false: set[str] = set()
    for node, at in went_silent:
        if node == victim and victim_ts is not None and at > victim_ts:
            found = at - victim_ts if found is None else found
        elif at <= window_end:
            false.add(node)
    return found, len(false)


# --- costs of one message, in this process -------------------------------------------------------


def decode_costs(repeat: int = 20000) -> dict[str, float]:
    """Microseconds per call of the supervisor's per-message work, without zmq."""
    secret = secrets.token_bytes(32)
    per_rank = Beat("n01024/3", (8195,), 0.0)
    per_node = Beat("n01024/0", tuple(range(8192, 8200)), 0.0)
    out: dict[str, float] = {}
    for label, beat in (("per-rank", per_rank), ("per-node", per_node)):
        msg = messages.Message(Kind.HEARTBEAT, beat.sender, 1, time.time(), heartbeat_body(beat, 1234))
        frames = messages.encode(msg, secret)
        payload = frames[1].decode("ascii")
        steps = {"n01024": NodeBeats(RANKS_PER_NODE)}

        def decode(frames: list[bytes] = frames) -> messages.Message:
            return messages.decode(frames, secret, allowed=messages.WORKER_KINDS, now=time.time())

        out[f"{label} bytes"] = len(frames[1])
        out[f"{label} decode"] = _per_call(decode, repeat)
        out[f"{label} json.loads"] = _per_call(lambda p=payload: json.loads(p), repeat)
        out[f"{label} bookkeeping"] = _per_call(
            lambda b=msg.body, s=steps, who=beat.sender: on_message(s, who, b, 1.0), repeat
        )
        out[f"{label} encode"] = _per_call(lambda m=msg: messages.encode(m, secret), repeat)
    out["hmac-sha256"] = _per_call(
        lambda: messages._mac(secret, messages.PROTOCOL_VERSION, frames[1]), repeat
    )
    for nodes in (256, 2048):
        steps = {node_name(n): NodeBeats(RANKS_PER_NODE) for n in range(nodes)}
        for name, step in steps.items():
            for k in range(RANKS_PER_NODE):
                step.seen(f"{name}/{k}", time.time())
        out[f"silence check, {nodes} nodes"] = _per_call(
            lambda s=steps: silent_nodes(s, time.time(), 1.0), 200
        )
    return out


def _per_call(fn: Any, repeat: int) -> float:
    return min(timeit.repeat(fn, number=repeat, repeat=3)) / repeat * 1e6


# --- output -------------------------------------------------------------------------------------


COLUMNS = (
    "scenario",
    "msg/s sent",
    "msg/s taken",
    "supervisor CPU",
    "main thread",
    "check",
    "us/msg",
    "delay p50/p99 ms",
    "detected after s",
    "false silences",
)


def row_cells(row: dict[str, Any]) -> list[str]:
    if "cpu_share" not in row:
        return [row["scenario"]["name"], f"{row['offered_rate']:,.0f}", "no window", *["-"] * 7]
    lat = row["latency_ms"]
    detection = "missed" if row["detection_s"] is None else f"{row['detection_s']:.2f}"
    if not row["scenario"]["victim"]:
        detection = "-"
    return [
        row["scenario"]["name"],
        f"{row['offered_rate']:,.0f}",
        f"{row['rate']:,.0f}",
        f"{row['cpu_share']:.0%}",
        f"{row['main_thread_share']:.0%}",
        f"{row['check_share']:.0%}",
        "-" if row["cpu_us_per_msg"] is None else f"{row['cpu_us_per_msg']:.1f}",
        f"{_num(lat['p50'])} / {_num(lat['p99'])}",
        detection,
        f"{row['false_silences']:,}",
    ]


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}" if value >= 10 else f"{value:.1f}"


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row_cells(row)) + " |" for row in rows]
    return "\n".join(lines)


SPLIT_COLUMNS = (
    "scenario",
    "us/msg",
    "zmq I/O thread",
    "main thread",
    "of it: decode+HMAC",
    "bookkeeping",
    "silence check",
    "zmq recv + loop",
    "cores at msg/s sent",
)


def split_cells(row: dict[str, Any], costs: dict[str, float]) -> list[str]:
    """Where one message's CPU time goes: the row's own shares, decode and bookkeeping from ``costs``."""
    if not row.get("rate"):
        return [row["scenario"]["name"], *["-"] * (len(SPLIT_COLUMNS) - 1)]
    kind = "per-node" if row["scenario"]["aggregate"] else "per-rank"
    per_msg = 1e6 / row["rate"]
    io_thread = (row["cpu_share"] - row["main_thread_share"]) * per_msg
    main = row["main_thread_share"] * per_msg
    check = row["check_share"] * per_msg
    decode, books = costs[f"{kind} decode"], costs[f"{kind} bookkeeping"]
    rest = main - decode - books - check
    return [
        row["scenario"]["name"],
        f"{row['cpu_us_per_msg']:.1f}",
        f"{io_thread:.1f}",
        f"{main:.1f}",
        f"{decode:.1f}",
        f"{books:.1f}",
        f"{check:.1f}",
        f"{rest:.1f}",
        f"{row['cpu_us_per_msg'] * row['offered_rate'] / 1e6:.2f}",
    ]


def split_table(rows: list[dict[str, Any]], costs: dict[str, float]) -> str:
    """Microseconds of supervisor CPU per message accepted, split (decode and bookkeeping measured alone)."""
    lines = ["| " + " | ".join(SPLIT_COLUMNS) + " |", "|" + "---|" * len(SPLIT_COLUMNS)]
    lines += ["| " + " | ".join(split_cells(row, costs)) + " |" for row in rows]
    return "\n".join(lines)


def progress_line(row: dict[str, Any]) -> str:
    """What one row's run looked like: connections, the generators' load, the loop."""
    gen = row["generators"]
    return (
        f"  {row['scenario']['name']}: {row['seconds']:.0f} s; {row['heard']:,} of {row['sockets']:,} "
        f"senders heard in {row['connect_s']} s; {gen['processes']} generators: {gen['cpu_share']:.0%} "
        f"of a core, {gen['refused']} sends refused, {gen['skipped']} beats skipped, up to "
        f"{gen['max_lateness_s']:.2f} s late; {row['rejected']:,} stale messages rejected; "
        f"{row.get('passes_per_s', 0):,.0f} loop passes/s"
    )


def environment() -> dict[str, Any]:
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "zmq": f"libzmq {zmq.zmq_version()}, pyzmq {zmq.__version__}",
        "fd_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[1],
        "load_average": os.getloadavg(),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.experiments.control_scale", description=__doc__.splitlines()[0]
    )
    p.add_argument("--quick", action="store_true", help="256 nodes and 3 s windows: checks that it works")
    p.add_argument("--nodes", type=int, help="simulated nodes of 8 ranks (default 2048; 256 with --quick)")
    p.add_argument("--only", help="comma-separated row numbers to run (1-based), e.g. 1,3")
    p.add_argument(
        "--profile", type=int, metavar="ROW", help="cProfile the supervisor's window of this row (1-based)"
    )
    p.add_argument("--json", type=Path, help="write the results as JSON to this path")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    nodes = args.nodes or (256 if args.quick else 2048)
    sizing = Sizing(window_s=2.0, stop_after_s=0.5, tail_s=1.5) if args.quick else Sizing()
    rows_to_run = scenarios(nodes)
    numbers = [int(k) - 1 for k in args.only.split(",")] if args.only else list(range(len(rows_to_run)))
    rows_to_run = [rows_to_run[k] for k in numbers]
    needed = max(s.senders for s in rows_to_run) + 64
    if raise_fd_limit() < needed:
        sys.exit(
            f"control_scale: {needed} file descriptors are needed and the hard limit is lower; use --nodes"
        )
    env = environment()
    print(
        f"control plane at scale, {env['date']} on {env['host']} ({env['cpus']} CPUs), {env['zmq']}",
        flush=True,
    )
    print(
        f"threshold {THRESHOLD_S:g} s, paced check every {CHECK_PACE_S:g} s, window {sizing.window_s:g} s",
        flush=True,
    )
    rows = []
    for n, scenario in zip(numbers, rows_to_run, strict=True):
        began = time.monotonic()
        row = run_scenario(scenario, sizing, profile=args.profile == n + 1)
        rows.append(row)
        row["seconds"] = round(time.monotonic() - began, 1)
        print(progress_line(row), flush=True)
        if "profile" in row:
            print(row.pop("profile"), flush=True)
    print()
    print(table(rows))
    costs = decode_costs(5000 if args.quick else 20000)
    print()
    print(split_table(rows, costs))
    print()
    print("per call, in one process (us): " + ", ".join(f"{k} {v:.1f}" for k, v in costs.items()))
    print(
        f"the host's load average (1, 5, 15 min): {env['load_average']} at the start, "
        f"{os.getloadavg()} at the end"
    )
    if args.json:
        args.json.write_text(
            json.dumps({"environment": env, "rows": rows, "costs_us": costs}, indent=2) + "\n"
        )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
