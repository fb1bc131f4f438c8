"""The rank programs of the sharded tests: real gloo ranks on 127.0.0.1, each a spawned process.

One tiny model (an MLP whose last layer has 6 rows: uneven shards on 4 ranks, and an empty
one), AdamW, data and dropout-free losses that are functions of (seed, rank, step). A rank
runs one *role*:

    ref        a fault-free run of ``steps`` steps in epoch 0
    survivor   ``k`` steps in epoch 0, the reconfigure to epoch 1 (driven by hand, as the
               supervisor's would arrive), then on to ``steps``
    lost       ``k`` steps in epoch 0, then the process ends (its rank is lost)
    spare      promoted live into epoch 1 at step -1: receives its shards, trains on
    drain      every rank of epoch 0 with a planned reconfigure queued (switch after ``k``):
               the leaving rank hands its shards over a socket and leaves
    ckpt       ``steps`` steps, a shard checkpoint every ``k``; with resume, from the newest

Each rank writes what it ends with (its own local shards, its reports) to ``out``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..gloo_ranks import FakeClient, info

#: Bounds each spawned rank: interpreters importing torch on 2 busy cores, a few tiny steps.
JOIN_TIMEOUT_S = 90
SEED = 7


def build(mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 6))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def train_step(step: int, model: nn.Module) -> torch.Tensor:
    import torch.distributed as dist

    g = torch.Generator().manual_seed(SEED * 1000 + dist.get_rank() * 100 + step)
    loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
    loss.backward()
    return loss


def layout_of(mesh: str) -> Any:
    from torchpass_slurm.mesh import MeshLayout

    r, s = (int(x) for x in mesh.split("x"))
    if r == 1:
        return MeshLayout(("shard",), (s,), replicate=None)
    return MeshLayout(("replicate", "shard"), (r, s))


def _runtime(rank: int, world: int, port: int, epoch: int, spare: bool, out: str) -> tuple[Any, FakeClient]:
    from torchpass_slurm.config import ENV_SECRET_FILE
    from torchpass_slurm.control.bodies import Promote, PromoteMode
    from torchpass_slurm.rank.runtime import Role, Runtime

    client = FakeClient()
    environ = {ENV_SECRET_FILE: str(secret_file(Path(out)))}  # the job's key seals every transfer
    rt = Runtime(Role.ACTIVE, info(rank, world, port, epoch), environ=environ, client=client)
    if spare:
        rt.is_spare_promoted = True
        rt.promotion = Promote(
            rank=rank,
            local_rank=0,
            world_size=world,
            master_addr="127.0.0.1",
            master_port=0,
            epoch=epoch,
            mode=PromoteMode.LIVE,
            store_addr="127.0.0.1",
            store_port=port,
        )
    return rt, client


def rank_main(role: str, rank: int, mesh: str, port: int, out: str, k: int, steps: int) -> None:
    from torchpass_slurm.control.bodies import Reconfigure
    from torchpass_slurm.rank.shard_state import local_state
    from torchpass_slurm.rank.sharded import ShardedTrainer

    torch.set_num_threads(1)
    layout = layout_of(mesh)
    world = layout.world_size
    rt, client = _runtime(rank, world, port, 1 if role == "spare" else 0, role == "spare", out)
    trainer = ShardedTrainer(rt, build, layout)
    ckpt = Path(out) / "ckpt"
    if role == "drain":
        rt.reconfigures.put(
            Reconfigure(
                epoch=1,
                world_size=world,
                store_addr="127.0.0.1",
                store_port=port,
                planned=True,
                leave=(1,),
                switch_after=k,
            )
        )
    if role in ("survivor", "lost"):
        trainer.fit(train_step, k)
        if role == "lost":
            return  # the process ends: rank 1 is lost
        trainer._reconfigure(Reconfigure(epoch=1, world_size=world, store_addr="127.0.0.1", store_port=port))
    if role == "resume":
        trainer.start()
        trainer.resume_from_checkpoint(ckpt)

    def on_commit(done: int, loss: torch.Tensor) -> None:
        if role == "ckpt" and done % k == 0:
            trainer.save_checkpoint(ckpt, done)

    trainer.fit(train_step, steps, on_commit)
    if trainer.released:
        return
    state, _ = local_state(trainer.model, trainer.optimizer)
    torch.save(
        {
            "state": _clone(state),
            "step": trainer.step,
            "reports": client.reports(),
            "received": trainer.received_state,
        },
        Path(out) / f"{role}{rank}.pt",
    )


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj


def secret_file(out: Path) -> Path:
    """The job's secret under ``out``, as tp-submit makes it in a run folder."""
    from torchpass_slurm.control.secret import SECRET_DIR, SECRET_NAME, create_secret

    path = out / SECRET_DIR / SECRET_NAME
    return path if path.exists() else create_secret(out)


def run(jobs: list[tuple[str, int]], mesh: str, port: int, out: Path, k: int, steps: int) -> None:
    """Run ``(role, rank)`` jobs as spawned processes until they end; every one must exit 0."""
    os.environ["USE_LIBUV"] = "0"
    secret_file(out)  # before the ranks start: they all read the same one
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=rank_main, args=(role, rank, mesh, port, str(out), k, steps))
        for role, rank in jobs
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(JOIN_TIMEOUT_S)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p in procs]
    assert codes == [0] * len(procs), list(zip(jobs, codes, strict=True))


def load(out: Path, role: str, rank: int) -> dict[str, Any]:
    return torch.load(out / f"{role}{rank}.pt", weights_only=True)


@contextlib.contextmanager
def host_store(out: Path) -> Iterator[int]:
    """The job's store on 127.0.0.1, for the secret under ``out`` that every rank reads, as tp
    run hosts it; its port."""
    from torchpass_slurm.control.secret import load_secret

    from ..gloo_ranks import job_store

    with job_store(load_secret(secret_file(out))) as server:
        yield server.port


def state_bytes(state: Any) -> int:
    from torchpass_slurm.rank.shard_state import state_bytes as nbytes

    return nbytes(state)
