"""The receive path alone (``control_scale --receive-path``): what one message costs, and
what each piece of the loop costs per call.

Issue 27 asks for a receive path within budget, to be chosen by measurement (aggregation,
batching, a compact encoding, one more level). This splits what one heartbeat costs the
supervisor's loop thread: a process of its own polls the real ``ControlServer`` as
``supervisor/loop.py``'s ``read_pass`` does, against a row's simulated agents
(:mod:`.control_scale_agents`, beating at the row's interval), four ways:

- each message as it comes (a poll returns with the first message there, as in the loop),
  or in batches (a wait of :data:`BATCH_WAIT_S` after each poll);
- with ``messages.decode`` (HMAC, JSON, schema, replay guard), or without: the server's
  ``Receiver`` answers every frame with one fixed message, so what is left is zmq's
  receive, the wake-up and the loop.

:func:`loop_costs` times the pieces of the loop in this process, for a steady job of N
nodes built as the benchmark's supervisor is (every step up, every node heard a moment
ago): decoding a node's beat, taking it (``Supervisor._take``), a silence check and its
three parts, a pass without one, and writing status.json.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import secrets
import tempfile
import time
import timeit
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from torchpass_slurm.control import messages
from torchpass_slurm.control.kinds import Kind
from torchpass_slurm.control.messages import Message
from torchpass_slurm.control.security import DEFAULT_LIMITS, raise_fd_limit
from torchpass_slurm.control.server import ControlServer

from .control_scale_agents import agents_main
from .control_scale_supervisor import CountingServer, World, build
from .control_scale_world import RANKS_PER_NODE, Row, node_beat_body

#: The wait after each poll in the batched modes.
BATCH_WAIT_S = 0.02
#: (label, wait after each poll, decode)
MODES = (
    ("each message as it comes", 0.0, True),
    ("each message, no decode", 0.0, False),
    (f"batched ({BATCH_WAIT_S * 1000:g} ms)", BATCH_WAIT_S, True),
    (f"batched ({BATCH_WAIT_S * 1000:g} ms), no decode", BATCH_WAIT_S, False),
)
#: The agents greet and settle this long; then the receiver measures this long.
WARM_S = 4.0
MEASURE_S = 8.0
TIMEOUT_S = 60.0


class FixedReceiver:
    """Stands in for the server's ``Receiver``: every frame is one fixed message, undecoded."""

    rejected = 0

    def __init__(self) -> None:
        self.message = Message(Kind.HEARTBEAT, "n00000/0", 1, time.time(), {})

    def accept(self, frames: Sequence[bytes], origin: str) -> Message:
        return self.message


def receiver_main(conn: Connection, secret: bytes, row: Row, wait_s: float, decode: bool) -> None:
    """Poll the real ControlServer from the origin ``conn`` sends: warm up, measure, report.
    Its gate admits every agent's handshake at once (``CountingServer`` says why)."""
    raise_fd_limit()
    connections = row.nodes + row.spares + 64
    limits = dataclasses.replace(DEFAULT_LIMITS, max_pending=max(DEFAULT_LIMITS.max_pending, connections))
    server = ControlServer(secret, "127.0.0.1", 0, limits=limits)
    if not decode:
        server._receiver = FixedReceiver()  # type: ignore[assignment]
    conn.send(server.endpoint)
    start = conn.recv() + WARM_S
    taken = polls = 0
    while time.monotonic() < start:
        server.poll(timedelta(seconds=0.1))
    wall0, cpu0, thread0 = time.monotonic(), time.process_time(), time.thread_time()
    while time.monotonic() < start + MEASURE_S:
        taken += len(server.poll(timedelta(seconds=0.1)))
        polls += 1
        if wait_s:
            time.sleep(wait_s)
    wall, cpu, thread = time.monotonic() - wall0, time.process_time() - cpu0, time.thread_time() - thread0
    server.close()
    conn.send(
        {
            "rate": taken / wall,
            "polls_per_s": polls / wall,
            "loop_us_per_msg": thread / taken * 1e6 if taken else None,
            "process_us_per_msg": cpu / taken * 1e6 if taken else None,
        }
    )


def receive_path(row: Row) -> list[dict[str, Any]]:
    """One measurement per mode, each with its own receiver and load generators."""
    out = []
    for label, wait_s, decode in MODES:
        ctx = mp.get_context("spawn")
        secret = secrets.token_bytes(32)
        mine, child = ctx.Pipe()
        procs = [ctx.Process(target=receiver_main, args=(child, secret, row, wait_s, decode), daemon=True)]
        procs[0].start()
        try:
            endpoint = _receive(mine, "the receiver's endpoint")
            conns = []
            for g in range(2):
                parent, child = ctx.Pipe()
                procs.append(
                    ctx.Process(target=agents_main, args=(child, endpoint, secret, row, g, 2), daemon=True)
                )
                procs[-1].start()
                conns.append(parent)
            for c in conns:
                _receive(c, "ready from a load generator")
            origin = time.monotonic() + 0.1
            for c in [*conns, mine]:
                c.send(origin)
            result = _receive(mine, "the receiver's numbers", WARM_S + MEASURE_S + TIMEOUT_S)
            for c in conns:
                c.send("end")
                _receive(c, "a load generator's numbers")
        finally:
            for proc in procs:
                proc.join(timeout=5)
                if proc.is_alive():
                    proc.terminate()
        out.append({"mode": label, "offered_rate": row.offered_rate, **result})
    return out


def _receive(conn: Connection, what: str, timeout_s: float = TIMEOUT_S) -> Any:
    if not conn.poll(timeout_s):
        raise SystemExit(f"control_scale: no {what} within {timeout_s:g} s (a process died or hangs)")
    return conn.recv()


def receive_table(row: Row, results: list[dict[str, Any]]) -> str:
    """The four ways as a markdown table."""
    lines = [
        f"| receive path, {row.name} | msg/s taken | polls/s | loop thread us/msg | process us/msg |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        loop, proc = r["loop_us_per_msg"], r["process_us_per_msg"]
        lines.append(
            f"| {r['mode']} | {r['rate']:,.0f} | {r['polls_per_s']:,.0f} | "
            f"{'-' if loop is None else f'{loop:.0f}'} | {'-' if proc is None else f'{proc:.0f}'} |"
        )
    return "\n".join(lines)


def loop_costs(nodes: int, repeat: int = 5) -> dict[str, float]:
    """Per call, in this process, for a steady job of ``nodes`` nodes x 8 (see the module
    docstring): microseconds per message, milliseconds per check, pass and status write
    (the best of ``repeat`` runs)."""
    secret = secrets.token_bytes(32)
    server = CountingServer(secret, connections=0)
    try:
        with tempfile.TemporaryDirectory(prefix="control-costs-") as run_dir:
            sup, _ = build(Row("costs", nodes), server, World(), Path(run_dir))
            m, now, mono = sup.membership, time.time(), time.monotonic()
            origin = mono - 10.0  # ten seconds into the training; the hellos a second ago
            for node in m.active:
                sup.job.launched(node, sup.launcher.launch(node, m))
                for local in range(RANKS_PER_NODE):
                    rank = m.rank_base(node) + local
                    hello = {"node": node, "rank": rank, "local_rank": local, "role": "active", "pid": 1}
                    msg = Message(Kind.HELLO, f"{node}/{local}", 1, now - 1.0, {**hello, "epoch": 0})
                    sup._take(b"peer", msg, now - 1.0)
            sup._after_messages()
            frames = [
                messages.encode(
                    Message(
                        Kind.HEARTBEAT,
                        f"{node}/0",
                        2,
                        now,
                        node_beat_body(m.rank_base(node), mono, origin, 0.25),
                    ),
                    secret,
                )
                for node in m.active
            ]
            receiver = messages.Receiver(secret, messages.WORKER_KINDS)
            decoded = [receiver.accept(f, "a node") for f in frames]

            def decode() -> None:
                guard = messages.Receiver(secret, messages.WORKER_KINDS)
                for f in frames:
                    guard.accept(f, "a node")

            def take() -> None:
                t = time.time()
                for msg in decoded:
                    sup._take(b"peer", msg, t)

            det = sup.detectors

            def check() -> None:
                det._next_silence_check = 0.0
                det.detect()

            take()
            sup.job.heard(time.time() + 3600)  # every beat taken: nobody silent during the timing
            det._next_slurm_poll = time.monotonic() + 3600
            out = {
                "decode a node's beat (us)": _best(decode, repeat) / nodes * 1000,
                "take it (us)": _best(take, repeat) / nodes * 1000,
                "silence check (ms)": _best(check, repeat),
                "  of it: confirmed silence (ms)": _best(det._confirmed_silence, repeat),
                "  of it: timeouts (ms)": _best(det._silence, repeat),
                "  of it: hang, no progress (ms)": _best(det._no_progress, repeat),
            }
            det._next_silence_check = time.monotonic() + 3600
            out["a pass without it: detect, reap (ms)"] = _best(det.detect, repeat) + _best(sup._reap, repeat)
            out["status.json (ms)"] = _best(lambda: sup._write_status(force=True), repeat)
            sup.events.close()
            return out
    finally:
        server.close()


def _best(fn: Callable[[], object], repeat: int) -> float:
    """Milliseconds of the fastest of ``repeat`` calls."""
    return min(timeit.repeat(fn, number=1, repeat=repeat)) * 1000


def costs_table(costs: dict[int, dict[str, float]]) -> str:
    """The per-call costs, one column per job size."""
    sizes = sorted(costs)
    lines = [
        "| per call | " + " | ".join(f"{n:,} nodes x 8" for n in sizes) + " |",
        "|---|" + "---|" * len(sizes),
    ]
    for key in costs[sizes[0]]:
        lines.append(f"| {key} | " + " | ".join(f"{costs[n][key]:.2f}" for n in sizes) + " |")
    return "\n".join(lines)
