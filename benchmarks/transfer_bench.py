#!/usr/bin/env python3
"""Transfer throughput: every transport and its baselines, between two processes, in one run.

On one machine (default) the script starts its two ranks itself over
127.0.0.1 (with ``mpiexec -n 1`` each when mpi4py is importable: MPICH
singletons cannot connect to each other). Between two cluster nodes::

    srun -N2 -n2 --mpi=pmi2 python benchmarks/transfer_bench.py --json out.json

(ranks from SLURM_PROCID/SLURM_NTASKS, rendezvous on the first node of
SLURM_STEP_NODELIST). Rank 0 receives and times; rank 1 sends.

Measured per size (10 MB, 100 MB, 500 MB; 2 GB with --large):

- ``raw-tcp``: plain Python sockets, 4 MiB buffers, sendall/recv_into (the baseline);
- ``socket+stream``: SocketTransport + send_state/recv_state (manifest, crc32 chunks);
- ``socket+sealed``: the same stream sealed with a job key (HMAC-SHA256 MACs: what a
  migration under tp run sends), against ``socket+stream`` in the same run;
- ``torch+stream`` and ``torch+sealed``: TorchTransport on a gloo group + the stream;
- ``gloo-raw``: one big tensor with gloo send/recv (the torch baseline);
- ``mpi-raw`` and ``mpi+stream``: MPICH connect/accept in the rank's own process
  (MPITransport), when mpi4py imports;
- ``mpi-helper+stream``: the product's MPI path (MPIProcessTransport: each rank's MPI runs in
  a helper process under a local ``mpiexec -n 1``), when MPICH's mpiexec.hydra is found; its
  start-up (launch to port published, to connected), which a recovery pays, is printed and
  written under ``startup`` in the JSON.

This is a script, not a test: numbers depend on the machine; never assert on them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from torchpass_slurm.rank.runtime import make_tcp_store
from torchpass_slurm.transfer import (
    SocketListener,
    SocketTransport,
    TorchTransport,
    recv_state,
    send_state,
)
from torchpass_slurm.transfer.seal import Seal

MB = 1_000_000
TIMEOUT = timedelta(seconds=300)
BUF = 4 << 20
#: Both ranks seal with this (a benchmark key; a job's comes from its secret).
SEAL = Seal(bytes(range(32)), "transfer benchmark")


#: The values of --mpi.
MPI_CHOICES = ("all", "helper", "none")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="10,100,500", help="sizes in MB, comma-separated (default 10,100,500)")
    p.add_argument("--large", action="store_true", help="also 2000 MB")
    p.add_argument("--repeat", type=int, default=2, help="runs per measurement; the best is kept")
    p.add_argument("--port", type=int, default=29631, help="rendezvous TCPStore port on rank 0's node")
    p.add_argument(
        "--mpi",
        choices=MPI_CHOICES,
        default="all",
        help="which MPI rows: all (in-process when mpi4py imports, and the helper when MPICH's "
        "hydra is found), helper (the product's path only: where torch links another MPI into the "
        "process, as Debian's does), none",
    )
    p.add_argument("--no-mpi", dest="mpi", action="store_const", const="none", help="the same as --mpi none")
    p.add_argument("--json", help="write the results as JSON to this path")
    p.add_argument("--role", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --- rendezvous --------------------------------------------------------------------------------


def slurm_rank() -> tuple[int, str] | None:
    """(rank, master host) under ``srun -n2``, else None."""
    if os.environ.get("SLURM_NTASKS") != "2" or "SLURM_PROCID" not in os.environ:
        return None
    import hostlist  # python-hostlist, a dependency of torchpass-slurm

    nodes = hostlist.expand_hostlist(
        os.environ.get("SLURM_STEP_NODELIST") or os.environ["SLURM_JOB_NODELIST"]
    )
    return int(os.environ["SLURM_PROCID"]), nodes[0]


class Peer:
    """This rank's view of the other: a TCPStore for small exchanges, barriers, the peer's host."""

    def __init__(self, rank: int, master: str, port: int) -> None:
        self.rank, self.master = rank, master
        # no libuv: Debian's torch is built without it (torchpass_slurm.rank.runtime.make_tcp_store)
        self.store = make_tcp_store(master, port, is_master=rank == 0, timeout=TIMEOUT)
        self.store.set(f"host{rank}", socket.gethostname() if master != "127.0.0.1" else "127.0.0.1")
        self.peer_host = self.store.get(f"host{1 - rank}").decode()
        self._n = 0

    def barrier(self) -> None:
        self._n += 1
        self.store.set(f"barrier{self._n}/{self.rank}", "1")
        self.store.wait([f"barrier{self._n}/{1 - self.rank}"])

    def share(self, key: str, value: str | None = None) -> str:
        """Rank 0 publishes ``value`` under ``key``; both get it."""
        if value is not None:
            self.store.set(key, value)
        return self.store.get(key).decode()


# --- measurements (each returns the receiver's seconds, or None on the sender) -------------------


def bench_raw_tcp(peer: Peer, nbytes: int) -> float | None:
    if peer.rank == 0:
        with SocketListener("0.0.0.0", 0) as listener:
            peer.share(f"raw-port{peer._n}", str(listener.port))
            listener.sock.settimeout(TIMEOUT.total_seconds())
            conn, _ = listener.sock.accept()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUF)
        buf = memoryview(bytearray(nbytes))
        began = time.perf_counter()
        conn.sendall(b"g")
        done = 0
        while done < nbytes:
            n = conn.recv_into(buf[done:])
            if n == 0:
                raise RuntimeError("raw-tcp: the sender closed early")
            done += n
        took = time.perf_counter() - began
        conn.close()
        return took
    port = int(peer.share(f"raw-port{peer._n}"))
    conn = socket.create_connection((peer.peer_host, port), timeout=TIMEOUT.total_seconds())
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUF)
    data = bytes(nbytes)
    conn.recv(1)
    conn.sendall(data)
    conn.close()
    return None


def make_state(nbytes: int) -> dict[str, Any]:
    """About ``nbytes`` of float32 tensors in a model-like dict (8 tensors)."""
    per = max(nbytes // 4 // 8, 1)
    return {"model": {f"layer{i}.weight": torch.full((per,), float(i)) for i in range(8)}, "step": 1}


def bench_stream(
    transport: Any, rank: int, state: dict[str, Any] | None, into: Any, seal: Seal | None = None
) -> float | None:
    if rank == 0:
        began = time.perf_counter()
        recv_state(transport, timeout=TIMEOUT, into=into, seal=seal)
        return time.perf_counter() - began
    send_state(transport, state, timeout=TIMEOUT, seal=seal)
    return None


def socket_transport(peer: Peer) -> Any:
    if peer.rank == 0:
        with SocketListener("0.0.0.0", 0) as listener:
            peer.share(f"sock-port{peer._n}", str(listener.port))
            return listener.accept(TIMEOUT)
    return SocketTransport.connect(peer.peer_host, int(peer.share(f"sock-port{peer._n}")), TIMEOUT)


def gloo_group(peer: Peer) -> Any:
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = TIMEOUT
    host = "127.0.0.1" if peer.master == "127.0.0.1" else socket.gethostname()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(dist.PrefixStore("bench-gloo", peer.store), peer.rank, 2, opts)


def bench_gloo_raw(pg: Any, rank: int, nbytes: int) -> float | None:
    buf = torch.empty(nbytes, dtype=torch.uint8) if rank == 0 else torch.ones(nbytes, dtype=torch.uint8)
    began = time.perf_counter()
    (pg.recv([buf], 1, 1) if rank == 0 else pg.send([buf], 0, 1)).wait(TIMEOUT)
    return time.perf_counter() - began if rank == 0 else None


def mpi_link(peer: Peer) -> Any:
    """An MPITransport between the two ranks (connect/accept, port name through the store)."""
    from torchpass_slurm.transfer import MPITransport

    if peer.rank == 0:
        return MPITransport.accept(lambda name: peer.share("mpi-port", name), TIMEOUT)
    return MPITransport.connect(peer.share("mpi-port"), TIMEOUT)


def mpi_helper_link(peer: Peer, startup: list[dict[str, float]]) -> Any:
    """An MPIProcessTransport between the two ranks; appends its start-up times to ``startup``."""
    from torchpass_slurm.transfer.mpi_process import MPIProcessTransport

    key = f"mpi-helper-port{peer._n}"
    began = time.perf_counter()
    if peer.rank == 0:
        published: list[float] = []

        def publish(name: str) -> None:
            published.append(time.perf_counter() - began)
            peer.share(key, name)

        transport = MPIProcessTransport.accept(publish, TIMEOUT)
        startup.append({"port_published_s": published[0], "connected_s": time.perf_counter() - began})
        return transport
    port = peer.share(key)
    began = time.perf_counter()
    transport = MPIProcessTransport.connect(port, TIMEOUT)
    startup.append({"connect_s": time.perf_counter() - began})
    return transport


def bench_mpi_raw(transport: Any, rank: int, nbytes: int) -> float | None:
    from mpi4py import MPI

    buf = torch.empty(nbytes, dtype=torch.uint8) if rank == 0 else torch.ones(nbytes, dtype=torch.uint8)
    began = time.perf_counter()
    if rank == 0:
        transport.comm.Recv([buf.numpy(), MPI.BYTE], source=0, tag=1)
        return time.perf_counter() - began
    transport.comm.Send([buf.numpy(), MPI.BYTE], dest=0, tag=1)
    return None


# --- driver ------------------------------------------------------------------------------------


def measure(
    peer: Peer,
    name: str,
    size_mb: int,
    repeat: int,
    fn: Callable[[], float | None],
    results: list[dict[str, Any]],
) -> None:
    best = None
    for _ in range(repeat):
        peer.barrier()
        took = fn()
        if took is not None:
            best = took if best is None else min(best, took)
    if peer.rank == 0 and best is not None:
        row = {
            "method": name,
            "size_mb": size_mb,
            "seconds": round(best, 4),
            "mb_per_s": round(size_mb / best, 1),
        }
        results.append(row)
        print(f"{name:<18} {size_mb:>6} MB {best:>8.3f} s {size_mb / best:>8.0f} MB/s", flush=True)


def measure_size(
    peer: Peer,
    size_mb: int,
    repeat: int,
    links: tuple[Any, Any, Any, Any],
    results: list[dict[str, Any]],
) -> None:
    """Every method at one size; the states live only for this call."""
    pg, sock, mpi, helper = links
    rank = peer.rank
    nbytes = size_mb * MB
    state = make_state(nbytes) if rank == 1 else None
    into = make_state(nbytes) if rank == 0 else None  # a spare's preallocated model
    torch_t = TorchTransport(1 - rank, pg)
    methods: list[tuple[str, Callable[[], float | None]]] = [
        ("raw-tcp", lambda: bench_raw_tcp(peer, nbytes)),
        ("socket+stream", lambda: bench_stream(sock, rank, state, into)),
        ("socket+sealed", lambda: bench_stream(sock, rank, state, into, SEAL)),
        ("gloo-raw", lambda: bench_gloo_raw(pg, rank, nbytes)),
        ("torch+stream", lambda: bench_stream(torch_t, rank, state, into)),
        ("torch+sealed", lambda: bench_stream(torch_t, rank, state, into, SEAL)),
    ]
    if mpi is not None:
        methods += [
            ("mpi-raw", lambda: bench_mpi_raw(mpi, rank, nbytes)),
            ("mpi+stream", lambda: bench_stream(mpi, rank, state, into)),
        ]
    if helper is not None:
        methods.append(("mpi-helper+stream", lambda: bench_stream(helper, rank, state, into)))
    for name, fn in methods:
        measure(peer, name, size_mb, repeat, fn, results)


def run_rank(args: argparse.Namespace, rank: int, master: str) -> None:
    torch.set_num_threads(1)
    peer = Peer(rank, master, args.port)
    sizes = [int(s) for s in args.sizes.split(",")] + ([2000] if args.large else [])
    use_mpi = args.mpi == "all" and _mpi_importable()
    peer.share("use-mpi", str(int(use_mpi))) if rank == 0 else None
    use_mpi = peer.share("use-mpi") == "1"
    use_helper = args.mpi != "none" and _hydra() is not None
    peer.share("use-helper", str(int(use_helper))) if rank == 0 else None
    use_helper = peer.share("use-helper") == "1"
    results: list[dict[str, Any]] = []
    pg = gloo_group(peer)
    sock = socket_transport(peer)
    mpi = mpi_link(peer) if use_mpi else None
    startup: list[dict[str, float]] = []
    helper = None
    for _ in range(args.repeat if use_helper else 0):  # the last link carries the row
        peer.barrier()
        if helper is not None:
            helper.close()
        helper = mpi_helper_link(peer, startup)
    if rank == 0:
        for times in startup:
            print("mpi-helper start-up: " + ", ".join(f"{k} {v:.3f}" for k, v in times.items()), flush=True)
        print(f"{'method':<18} {'size':>9} {'time':>10} {'throughput':>13}", flush=True)
    for size_mb in sizes:
        measure_size(peer, size_mb, args.repeat, (pg, sock, mpi, helper), results)
    peer.barrier()
    if helper is not None:
        helper.close()
    if rank == 0 and args.json:
        doc = {"environment": environment(master, use_mpi), "results": results, "startup": startup}
        Path(args.json).write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.json}")


def _mpi_importable() -> bool:
    from torchpass_slurm.transfer.mpi_transport import mpi_problem

    return mpi_problem() is None


def _hydra() -> str | None:
    from torchpass_slurm.transfer.mpi_process import find_hydra

    return find_hydra()


def environment(master: str, mpi_in_process: bool) -> dict[str, Any]:
    env: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "where": "host loopback" if master == "127.0.0.1" else f"two nodes (master {master})",
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "chunk_bytes": 4 << 20,
        "digest": "crc32",
    }
    if mpi_in_process:  # else mpi4py is never imported here (the helper runs MPI)
        from mpi4py import MPI

        env["mpi"] = MPI.Get_library_version().splitlines()[0].strip()
    return env


def launch_local(args: argparse.Namespace, argv: list[str]) -> int:
    """Start both ranks on this machine (each under mpiexec -n 1 when MPI is usable)."""
    mpiexec = None
    if args.mpi == "all" and _mpi_importable():
        import shutil

        mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    procs = []
    for rank in (0, 1):
        cmd = [sys.executable, __file__, *argv, "--role", str(rank)]
        procs.append(subprocess.Popen([mpiexec, "-n", "1", *cmd] if mpiexec else cmd))
    return max(p.wait() for p in procs)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.role is not None:
        run_rank(args, args.role, "127.0.0.1")
        return 0
    under_slurm = slurm_rank()
    if under_slurm is not None:
        run_rank(args, *under_slurm)
        return 0
    return launch_local(args, argv)


if __name__ == "__main__":
    sys.exit(main())
