"""What the job's authenticated store costs a rendezvous: torch's TCPStore (before) against
the job store (after), in one run, on loopback.

    python -m benchmarks.experiments.store_rendezvous                       # 6 and 16 ranks, 5 epochs each
    python -m benchmarks.experiments.store_rendezvous --ranks 6,32 --epochs 10 --json F

For each world size, ``--ranks`` processes are started once (torch imported,
the store connected) and then build ``--epochs`` process groups one after the
other, as survivors do after a fault: count in at ``epoch<N>/torchpass/joined``
and wait for everyone (``rank/rendezvous.py``'s loop), ``init_process_group``
(gloo) over ``PrefixStore("epoch<N>")``, one all-reduce, ``destroy_process_group``.
An epoch's time is from the moment every rank was told to start until the last
rank's all-reduce returned. Rows:

* ``TCPStore (before)``: torch's store in a child process, as ``tp run`` hosted it;
* ``job store (after)``: ``StoreHost`` as ``tp run`` hosts it now, reached by
  :class:`~torchpass_slurm.rank.store.JobStore` with the job's secret (CURVE).

This is a script, not a test: numbers depend on the machine; never assert on them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from torchpass_slurm.control.secret import create_secret
from torchpass_slurm.supervisor.store_host import StoreHost

TIMEOUT = datetime.timedelta(seconds=60)
POLL_S = 0.05  # rank/rendezvous.py's POLL_S


def rank_main(
    kind: str, rank: int, world: int, port: int, secret_file: str, epochs: int, go: Any, out: Any
) -> None:
    import torch
    import torch.distributed as dist

    if kind == "tcpstore":
        from torchpass_slurm.rank.rendezvous import make_tcp_store

        client = make_tcp_store("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    else:
        from torchpass_slurm.control.secret import load_secret
        from torchpass_slurm.rank.store import JobStore

        client = JobStore("127.0.0.1", port, load_secret(Path(secret_file)), TIMEOUT)
    client.set(f"ready/{rank}", "1")
    for epoch in range(epochs):
        go[epoch].wait()
        store = dist.PrefixStore(f"epoch{epoch}", client)
        store.add("torchpass/joined", 1)
        while store.add("torchpass/joined", 0) < world:
            time.sleep(POLL_S)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
        value = torch.ones(1)
        dist.all_reduce(value)
        dist.destroy_process_group()
        out.put((epoch, rank, time.time()))


class TorchStoreHost:
    """torch's TCPStore in a child process, as tp run hosted it before the job store."""

    CODE = (
        "import datetime, sys\n"
        "from torchpass_slurm.rank.rendezvous import make_tcp_store\n"
        "s = make_tcp_store('127.0.0.1', 0, is_master=True, timeout=datetime.timedelta(seconds=60))\n"
        "print(s.port, flush=True)\n"
        "sys.stdin.read()\n"
    )

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", self.CODE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(10)


def row(kind: str, world: int, epochs: int, secret_file: Path) -> dict[str, Any]:
    host: Any = TorchStoreHost() if kind == "tcpstore" else StoreHost.start("127.0.0.1", secret_file, TIMEOUT)
    ctx = mp.get_context("spawn")
    go = [ctx.Event() for _ in range(epochs)]
    out = ctx.Queue()
    args = (host.port, str(secret_file), epochs, go, out)
    procs = [ctx.Process(target=rank_main, args=(kind, r, world, *args)) for r in range(world)]
    try:
        for p in procs:
            p.start()
        _wait_ready(kind, host.port, secret_file, world)
        times = []
        for epoch in range(epochs):
            started = time.time()
            go[epoch].set()
            ends = [out.get(timeout=TIMEOUT.total_seconds()) for _ in range(world)]
            assert {e for e, _, _ in ends} == {epoch}
            times.append(max(t for _, _, t in ends) - started)
            print(f"  {kind} {world} ranks, epoch {epoch}: {times[-1] * 1000:.0f} ms", flush=True)
        for p in procs:
            p.join(30)
        assert [p.exitcode for p in procs] == [0] * world
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        host.close()
    return {
        "store": "TCPStore (before)" if kind == "tcpstore" else "job store (after)",
        "ranks": world,
        "epochs": epochs,
        "median_s": statistics.median(times),
        "first_s": times[0],
        "max_s": max(times),
    }


def _wait_ready(kind: str, port: int, secret_file: Path, world: int) -> None:
    """Until every rank has imported torch and connected (their ``ready/R`` keys)."""
    if kind == "tcpstore":
        from torchpass_slurm.rank.rendezvous import make_tcp_store

        client: Any = make_tcp_store("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    else:
        from torchpass_slurm.control.secret import load_secret
        from torchpass_slurm.rank.store import JobStore

        client = JobStore("127.0.0.1", port, load_secret(secret_file), TIMEOUT)
    client.wait([f"ready/{r}" for r in range(world)], TIMEOUT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="6,16", help="world sizes, comma-separated (default 6,16)")
    parser.add_argument("--epochs", type=int, default=5, help="groups built one after the other per row")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    args = parser.parse_args(argv)
    os.environ["USE_LIBUV"] = "0"  # as tp run's ranks (Debian's torch has no libuv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        secret_file = create_secret(Path(tmp))
        for world in (int(w) for w in args.ranks.split(",")):
            for kind in ("tcpstore", "jobstore"):
                rows.append(row(kind, world, args.epochs, secret_file))
    print(f"\nrendezvous + first all-reduce, {platform.node()}, {os.cpu_count()} cores, loopback")
    print("| store | ranks | median | first epoch | slowest |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['store']} | {r['ranks']} | {r['median_s'] * 1000:.0f} ms | "
            f"{r['first_s'] * 1000:.0f} ms | {r['max_s'] * 1000:.0f} ms |"
        )
    if args.json:
        stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        args.json.write_text(json.dumps({"date": stamp, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
