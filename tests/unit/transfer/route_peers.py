"""One end of a routed transfer (``rank/routes.py``) in a process of its own, for
test_routes.py: ``python -m tests.unit.transfer.route_peers JSON``, a plain process as a rank
is (over MPI each end starts its own helper under a local ``mpiexec -n 1``).

JSON: ``role`` (donor | receiver), ``store`` (the test's TCPStore port), ``kind``, ``out``
(a file for what happened) and, per role: ``donors`` (the receiver's donors, in order),
``die_at`` (a donor SIGKILLs itself before that chunk), ``kill_helper_at`` (a donor SIGKILLs
its MPI helper before that chunk), ``hydra`` (the path of MPICH's mpiexec.hydra: a bogus one
stands for MPI missing), ``libmpi`` (the MPI library the helper loads: a bogus one stands for
an MPI that cannot start), ``stall`` (seconds of MPI_STALL_TIMEOUT), ``gloo`` (fall back to a
gloo pair of its own). What happened goes to ``out`` as JSON, with the seconds the donor took.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tests.unit.transfer.peers import DyingTransport, gloo_pair
from torchpass_slurm.errors import TransferError
from torchpass_slurm.rank import routes
from torchpass_slurm.transfer import ReceiveProgress, mpi_process
from torchpass_slurm.transfer.seal import Seal

SECRET = b"0123456789abcdef-the-job-secret"
TIMEOUT = timedelta(seconds=20)


def make_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {"w": torch.randn(4 << 20, generator=g), "b": torch.arange(10), "step": 3}  # 16 MiB: 4 chunks


def seal(donor: int, receiver: int = 9) -> Seal:
    return Seal(SECRET, f"job 1 epoch 2 step 3 rank {donor}->rank {receiver}")


def main(arg: str) -> None:
    job = json.loads(arg)
    base = dist.TCPStore("127.0.0.1", job["store"], is_master=False, timeout=TIMEOUT)
    store = dist.PrefixStore("epoch2", base)
    began = time.monotonic()
    if "hydra" in job:
        mpi_process.find_hydra = lambda: job["hydra"]
    if "libmpi" in job:
        mpi_process.HelperLaunch.libmpi = lambda self: job["libmpi"]  # type: ignore[method-assign]
    if "stall" in job:
        routes.MPI_STALL_TIMEOUT = timedelta(seconds=job["stall"])
    result: dict[str, Any] = {}
    if job["role"] == "donor":
        rank = job["rank"]

        def fallback() -> Any:
            from torchpass_slurm.transfer import TorchTransport

            return TorchTransport(1, gloo_pair(base, f"fallback{rank}", 0, TIMEOUT))

        accept = mpi_process.MPIProcessTransport.accept

        def dying(*args: Any, **kwargs: Any) -> Any:
            inner = accept(*args, **kwargs)
            if "die_at" in job:  # this process
                return DyingTransport(inner, job["die_at"])
            return DyingTransport(inner, job["kill_helper_at"], victim=lambda: inner.helper_pid)

        if "die_at" in job or "kill_helper_at" in job:
            mpi_process.MPIProcessTransport.accept = dying  # type: ignore[method-assign]
        key = routes.ROUTE_KEY.format(donor=rank, receiver=9)
        stats, via = routes.send_routed(
            job["kind"], store, key, seal(rank), "127.0.0.1", make_state(), {"step": 3}, fallback
        )
        result = {"via": via, "bytes": stats.bytes, "resumed_from": stats.resumed_from}
    else:
        progress = ReceiveProgress()
        tries = []
        for rank in job["donors"]:

            def fallback(rank: int = rank) -> Any:
                if not job.get("gloo"):
                    raise TransferError(f"the group to rank {rank} is gone (the test's stand-in)")
                from torchpass_slurm.transfer import TorchTransport

                return TorchTransport(0, gloo_pair(base, f"fallback{rank}", 1, TIMEOUT))

            key = routes.ROUTE_KEY.format(donor=rank, receiver=9)
            try:
                received, stats, via = routes.receive_routed(
                    job["kind"], store, key, seal(rank), fallback, into=None, progress=progress, accept=None
                )
            except TransferError as exc:
                tries.append(str(exc)[:200])
                continue
            torch.save(received, job["out"] + ".pt")
            result = {"via": via, "resumed_from": stats.resumed_from, "donor": rank, "failed": tries}
            break
        else:
            result = {"failed": tries}
    with open(job["out"], "w") as f:
        json.dump({**result, "seconds": round(time.monotonic() - began, 2)}, f)


if __name__ == "__main__":
    main(sys.argv[1])
