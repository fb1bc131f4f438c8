"""One end of a routed transfer (``rank/routes.py``) in a process of its own, for
test_routes.py: ``python -m tests.unit.transfer.route_peers JSON``, under ``mpiexec -n 1`` for
MPI (two MPICH singletons cannot connect), as two ``srun --mpi=pmi2`` steps on a cluster.

JSON: ``role`` (donor | receiver), ``store`` (the test's TCPStore port), ``kind``, ``out``
(a file for what happened) and, per role: ``donor`` (the receiver's donors, in order),
``die_at`` (a donor SIGKILLs itself before that chunk), ``no_mpi`` (mpi4py "missing"),
``stall`` (seconds of MPI_STALL_TIMEOUT), ``gloo`` (fall back to a gloo pair of its own).
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tests.unit.transfer.peers import DyingTransport, gloo_pair
from torchpass_slurm.errors import TransferError
from torchpass_slurm.rank import routes
from torchpass_slurm.transfer import ReceiveProgress
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
    if job.get("no_mpi"):
        import torchpass_slurm.transfer.mpi_transport as mpi_transport

        mpi_transport.mpi_problem = lambda: "mpi4py is not importable (the test said so)"
    if "stall" in job:
        routes.MPI_STALL_TIMEOUT = timedelta(seconds=job["stall"])
    result: dict[str, Any] = {}
    if job["role"] == "donor":
        rank = job["rank"]

        def fallback() -> Any:
            from torchpass_slurm.transfer import TorchTransport

            return TorchTransport(1, gloo_pair(base, f"fallback{rank}", 0, TIMEOUT))

        if "die_at" in job:
            from torchpass_slurm.transfer import mpi_transport

            accept = mpi_transport.MPITransport.accept
            mpi_transport.MPITransport.accept = lambda *a, **k: DyingTransport(accept(*a, **k), job["die_at"])  # type: ignore[assignment,method-assign]
        key = routes.ROUTE_KEY.format(donor=rank, receiver=9)
        stats, via = routes.send_routed(
            job["kind"], store, key, seal(rank), "127.0.0.1", make_state(), {"step": 3}, fallback
        )
        result = {"via": via, "bytes": stats.bytes}
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
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
