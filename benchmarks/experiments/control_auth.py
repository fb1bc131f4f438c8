"""What CURVE costs the supervisor: heartbeats per second one core verifies, before and after.

    python -m benchmarks.experiments.control_auth              # 100,000 heartbeats per row (~20 s)
    python -m benchmarks.experiments.control_auth --count 20000 --senders 16

Two rows, measured one after the other in one run:

* ``plain (before)``: the real :class:`~torchpass_slurm.control.server.ControlServer`
  with CURVE switched off (``make_curve_server`` and ``make_curve_client``
  replaced by no-ops in this process): ZMTP's NULL mechanism, then the HMAC
  check, the replay guard and the JSON decode, as before CURVE;
* ``CURVE (after)``: the real server as ``tp run`` builds it.

A load generator (a process of its own) connects ``--senders`` DEALER sockets
and sends pre-signed per-rank heartbeats as fast as the queues take them.
The supervisor's process loops on :meth:`ControlServer.poll` until it has
accepted every one. "per core" divides the accepted messages by the
supervisor process's CPU time (every thread: its loop and zmq's I/O thread,
which decrypts), so it does not depend on how much of the host's cores the
generator took. A third line gives the cost of ``decode`` alone (no zmq).

This is a script, not a test: numbers depend on the machine; never assert on them.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import secrets
import sys
import time
import timeit
from datetime import datetime, timedelta, timezone
from multiprocessing.connection import Connection
from typing import Any

import zmq

from torchpass_slurm.control import client as client_mod
from torchpass_slurm.control import messages
from torchpass_slurm.control import server as server_mod
from torchpass_slurm.control.client import configure_socket
from torchpass_slurm.control.kinds import Kind
from torchpass_slurm.control.security import derive_keys, make_curve_client
from torchpass_slurm.control.server import ControlServer

#: Longest a row may take before it is given up.
ROW_TIMEOUT_S = 120.0


def _no_curve(*_args: Any) -> None:
    """Stands in for make_curve_server / make_curve_client in the 'before' row."""


def heartbeat(sender: str, seq: int, rank: int) -> list[bytes]:
    body = {"rank": rank, "step": 1234, "state": "training", "phase": "compute"}
    return messages.encode(messages.Message(Kind.HEARTBEAT, sender, seq, time.time(), body), SECRET)


SECRET = b""  # set per run in main() and passed to the children


def generator_main(
    secret: bytes, endpoint: str, curve: bool, senders: int, count: int, conn: Connection
) -> None:
    global SECRET
    SECRET = secret
    per_sender = count // senders
    frames = [[heartbeat(f"n{s:04d}/0", 1 + i, s) for i in range(per_sender)] for s in range(senders)]
    ctx = zmq.Context()
    socks = []
    for _ in range(senders):
        sock = ctx.socket(zmq.DEALER)
        configure_socket(sock)
        sock.setsockopt(zmq.SNDHWM, 0)  # unbounded: the server's pace, not the HWM, limits the rate
        if curve:
            make_curve_client(sock, derive_keys(secret))
        sock.connect(endpoint)
        socks.append(sock)
    conn.send("ready")
    conn.recv()  # go
    for i in range(per_sender):
        for s, sock in enumerate(socks):
            sock.send_multipart(frames[s][i], copy=False)
    conn.recv()  # the server has them all
    for sock in socks:
        sock.close(linger=0)
    ctx.term()


def run_row(curve: bool, senders: int, count: int) -> dict[str, float]:
    if not curve:
        server_mod.make_curve_server = _no_curve  # type: ignore[assignment]
        client_mod.make_curve_client = _no_curve  # type: ignore[assignment]
    server = ControlServer(SECRET, "127.0.0.1")
    total = (count // senders) * senders
    parent, child = mp.Pipe()
    gen = mp.get_context("spawn").Process(
        target=generator_main, args=(SECRET, server.endpoint, curve, senders, count, child)
    )
    gen.start()
    assert parent.recv() == "ready"
    accepted = 0
    parent.send("go")
    first = server.poll(timedelta(seconds=30))
    accepted += len(first)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    deadline = time.monotonic() + ROW_TIMEOUT_S
    while accepted < total and time.monotonic() < deadline:
        accepted += len(server.poll(timedelta(milliseconds=200)))
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    parent.send("done")
    gen.join(timeout=30)
    rejected = server.rejected
    server.close()
    measured = accepted - len(first)
    return {
        "messages": float(accepted),
        "rejected": float(rejected),
        "wall s": wall,
        "cpu s": cpu,
        "msg/s wall": measured / wall if wall else 0.0,
        "msg/s per core": measured / cpu if cpu else 0.0,
        "us/msg cpu": cpu / measured * 1e6 if measured else 0.0,
    }


def decode_cost(repeat: int = 20000) -> float:
    frames = heartbeat("n0001/0", 1, 1)
    now = time.time()

    def once() -> messages.Message:
        return messages.decode(frames, SECRET, allowed=messages.WORKER_KINDS, now=now)

    return min(timeit.repeat(once, number=repeat, repeat=3)) / repeat * 1e6


def main(argv: list[str] | None = None) -> int:
    global SECRET
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=100_000, help="heartbeats per row")
    parser.add_argument("--senders", type=int, default=64, help="DEALER sockets of the generator")
    args = parser.parse_args(argv)
    SECRET = secrets.token_bytes(32)
    print(
        f"# control_auth {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
        f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}, libzmq {zmq.zmq_version()}, "
        f"pyzmq {zmq.__version__}; {args.count} heartbeats from {args.senders} sockets per row"
    )
    rows = {}
    # CURVE first: the 'before' row replaces the CURVE functions in this process for good
    rows["CURVE (after)"] = run_row(True, args.senders, args.count)
    rows["plain (before)"] = run_row(False, args.senders, args.count)
    cols = ["messages", "rejected", "wall s", "cpu s", "msg/s wall", "msg/s per core", "us/msg cpu"]
    print(f"{'row':<16}" + "".join(f"{c:>16}" for c in cols))
    for name in ("plain (before)", "CURVE (after)"):
        print(f"{name:<16}" + "".join(f"{rows[name][c]:>16.{0 if c in cols[:2] else 2}f}" for c in cols))
    before, after = rows["plain (before)"]["msg/s per core"], rows["CURVE (after)"]["msg/s per core"]
    print(
        f"CURVE costs {100 * (1 - after / before):.0f}% of the verified heartbeats per core "
        f"({before:,.0f} -> {after:,.0f} msg/s per core)"
    )
    print(f"decode alone (HMAC + JSON + checks, no zmq): {decode_cost():.1f} us per heartbeat")
    return 0


if __name__ == "__main__":
    sys.exit(main())
