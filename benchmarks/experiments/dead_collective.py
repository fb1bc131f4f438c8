"""How long a survivor sits in a dead collective: no teardown, teardown, abort; killed and frozen peers.

Three processes form a gloo group on 127.0.0.1 (the TCPStore is hosted here,
as ``tp run`` hosts it) and all-reduce in a loop, each holding a DDP wrapper
as ``ElasticTrainer`` does. Once every rank is looping, the victim (rank 1)
gets SIGKILL (a dead process: its kernel closes its sockets, the peers get
a FIN or an RST) or SIGSTOP (a frozen or powered-off node: its sockets stay
open and nothing arrives). Each survivor records when its collective
raised; what it does then is the mode:

=============  ==========================================================
``plain``      nothing: it keeps the broken group (the code before issue 12)
``held``       ``destroy_process_group()`` while its DDP wrapper still holds the group
``teardown``   drops the DDP wrapper and the exception's frames, then destroys the group
               (``ElasticTrainer._tear_down``: ``release_references``, ``destroy_group``)
``abort``      nothing on failure; another thread aborts the group at +0.5 s
               (``abort_group_before`` with no socket recorded: ``ProcessGroup.abort`` alone)
``sockets``    as ``abort``, with the group's sockets recorded at init (``group_sockets``,
               as ``EpochRendezvous.join`` does): the abort shuts them down, then
               calls ``ProcessGroup.abort`` where there is one
=============  ==========================================================

(``abort`` and ``sockets`` are the reconfigure arriving in the heartbeat
thread; on a torch without ``ProcessGroup.abort`` the abort column is left
out.) Run::

    python -m benchmarks.experiments.dead_collective [--timeout 15] [--modes plain,teardown,abort,sockets]

It prints one row per survivor and victim signal: seconds from the signal
to the survivor leaving its collective (``>T`` = the collective timeout, T
seconds). A script, not a test: the numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

WORLD = 3
VICTIM = 1
#: Seconds from the victim's signal to the abort (the reconfigure's arrival): ``abort``, ``sockets``.
ABORT_AFTER_S = 0.5
MODES = ("plain", "held", "teardown", "abort", "sockets")
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


@dataclass(frozen=True)
class Left:
    """One survivor leaving its collective."""

    rank: int
    at: float  # time.monotonic() (one clock for every process of the host)
    error: str


def _worker(
    rank: int, port: int, timeout_s: float, mode: str, looping: Any, signalled: Any, done: Any, results: Any
) -> None:
    """One rank: join, all-reduce until a collective fails, then act as ``mode`` says."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from torchpass_slurm.rank.group import (
        adopt_group,
        destroy_group,
        group_sockets,
        release_references,
        socket_inodes,
    )
    from torchpass_slurm.rank.rendezvous import make_tcp_store

    log = logging.LoggerAdapter(logging.getLogger("dead_collective"), {})
    timeout = datetime.timedelta(seconds=timeout_s)
    store = make_tcp_store("127.0.0.1", port, is_master=False, timeout=timeout)
    before = socket_inodes()
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("epoch0", store), rank=rank, world_size=WORLD, timeout=timeout
    )
    sockets = group_sockets(before, exclude_ports={port}) if mode == "sockets" else ()
    ddp: Any = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
    adopt_group(0, sockets)
    if mode in ("abort", "sockets"):
        threading.Thread(target=_abort_later, args=(signalled, log), daemon=True).start()
    data = torch.ones(1 << 14)
    step = 0
    try:
        while True:
            dist.all_reduce(data)
            step += 1
            if step == 20:
                looping.put(rank)
    except RuntimeError as exc:
        left = Left(rank, time.monotonic(), str(exc).splitlines()[0][:90])
        if mode == "teardown":  # what ElasticTrainer._tear_down does
            del ddp  # the wrapper holds the group
            release_references(exc)
            del exc
            destroy_group(log)
        elif mode == "held":
            dist.destroy_process_group()
        results.put(left)
    _wait_for(lambda: done.value, timeout_s + 30)
    os._exit(0)  # no destructors: a plain survivor must not close its sockets on the way out


def _abort_later(signalled: Any, log: Any) -> None:
    """What the heartbeat thread does when the reconfigure to epoch 1 arrives."""
    from torchpass_slurm.rank.group import abort_group_before

    _wait_for(lambda: signalled.value, 3600)
    time.sleep(max(0.0, signalled.value + ABORT_AFTER_S - time.monotonic()))
    abort_group_before(1, log)


def _wait_for(flag: Any, seconds: float) -> None:
    """Poll a lock-free shared value: a process killed inside an Event's lock would leave it held."""
    deadline = time.monotonic() + seconds
    while not flag() and time.monotonic() < deadline:
        time.sleep(0.01)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_once(mode: str, how: str, timeout_s: float) -> dict[int, Left | None]:
    """Start the ranks, signal the victim, collect when each survivor left; kill them all."""
    from torchpass_slurm.rank.rendezvous import make_tcp_store

    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    store = make_tcp_store(
        "127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=timeout_s + 60)
    )
    looping, results = ctx.Queue(), ctx.Queue()
    signalled, done = ctx.Value("d", 0.0, lock=False), ctx.Value("b", 0, lock=False)
    procs = [
        ctx.Process(
            target=_worker, args=(r, port, timeout_s, mode, looping, signalled, done, results), daemon=True
        )
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    try:
        for _ in range(WORLD):
            looping.get(timeout=120)
        time.sleep(0.2)
        os.kill(procs[VICTIM].pid, SIGNALS[how])
        t0 = time.monotonic()
        signalled.value = t0
        left: dict[int, Left | None] = {r: None for r in range(WORLD) if r != VICTIM}
        deadline = t0 + timeout_s + 10
        while any(v is None for v in left.values()) and time.monotonic() < deadline:
            try:
                got: Left = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:  # queue.Empty: a survivor never left; reported as such
                break
            left[got.rank] = Left(got.rank, got.at - t0, got.error)
        return left
    finally:
        done.value = 1
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        del store


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--timeout",
        type=float,
        default=15.0,
        help="the group's collective timeout, seconds (TORCHPASS_COLLECTIVE_TIMEOUT: 15)",
    )
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--signals", default=",".join(SIGNALS))
    args = parser.parse_args(argv)
    import torch
    import torch.distributed as dist

    modes = [m for m in args.modes.split(",") if m]
    if "abort" in modes and not hasattr(dist.ProcessGroup, "abort"):
        print(f"torch {torch.__version__} has no ProcessGroup.abort: the abort column is left out")
        modes.remove("abort")
    table: dict[tuple[str, int], dict[str, str]] = {}
    errors: list[str] = []
    for how in [s for s in args.signals.split(",") if s]:
        for mode in modes:
            for rank, left in run_once(mode, how, args.timeout).items():
                cell = f">{args.timeout:g}" if left is None else f"{left.at:.3f}"
                table.setdefault((how, rank), {})[mode] = cell
                if left is not None:
                    errors.append(f"{how:4} {mode:8} rank {rank}: {left.error}")
    print(
        f"torch {torch.__version__}, gloo, {WORLD} ranks on 127.0.0.1, victim rank {VICTIM}, "
        f"collective timeout {args.timeout:g} s; seconds from the signal to leaving the collective"
    )
    print(f"{'victim':8} {'survivor':9} " + " ".join(f"{m:>9}" for m in modes))
    for (how, rank), cells in sorted(table.items()):
        print(f"{how:8} {'rank ' + str(rank):9} " + " ".join(f"{cells.get(m, '-'):>9}" for m in modes))
    print("\nwhat each survivor's collective raised:")
    print("\n".join(errors))
    return 0


if __name__ == "__main__":
    sys.exit(main())
