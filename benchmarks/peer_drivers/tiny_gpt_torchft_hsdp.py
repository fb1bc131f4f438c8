#!/usr/bin/env python3
"""tiny_gpt_hsdp's HSDP trained by torchft: the open peer's way of doing a replicate x shard mesh.

torchft 0.2.0 has no HSDP entry point of its own; this is the wiring TorchTitan uses with it
(``torchtitan/experiments/torchft``), written for the tiny GPT:

- each replica group is its own ``torch.distributed`` world (gloo) of ``SHARDS`` ranks, one
  per node, doing FSDP2 ``fully_shard`` on a 1-D ``("shard",)`` mesh: the model and optimizer
  of ``tiny_gpt_hsdp.builder`` (every block one FSDP unit), the data, dropout seeds and the
  full-state hash of ``tiny_gpt.py`` / ``tiny_gpt_hsdp.py``, imported;
- the replicate dimension is a ``torchft.Manager`` per group over a reconfigurable
  ``ProcessGroupGloo`` (shard rank ``r`` of every group in one cross-group gloo group, rebuilt
  at each new quorum), wired in with FSDP's ``set_all_reduce_hook``: after the reduce-scatter
  in the group, each shard's gradient is averaged over the participating groups by
  ``Manager.allreduce`` (what TorchTitan's hook reaches through ``ManagedProcessGroup``);
- the Manager's settings are tiny_gpt_torchft.py's (train_ddp.py's), and ``init_sync=False``:
  the groups' initial weights are identical by the seed;
- ``torchft.Optimizer`` wraps AdamW: ``zero_grad`` starts the quorum, ``step`` applies the
  update only if every rank of the group agrees at ``should_commit``;
- a recovering group heals from a healthy one shard by shard: rank ``r`` receives the sharded
  parameters and optimizer state of rank ``r`` of the healthy group (the same shard
  coordinate) over the cross-group group (``PGTransport``). As TorchTitan's checkpointer
  does, the state handed to torchft is built once and refers to the sharded tensors, which the
  optimizer updates in place: torchft sends it from its quorum thread while the forward runs
  (and has the parameters unsharded).

Rank ``r`` of group ``g`` is rank ``g * SHARDS + r`` of the ``GROUPS * SHARDS`` mesh of
``tiny_gpt_hsdp.py --mesh GROUPSxSHARDS`` (row-major), and reads at step ``s`` what that rank
reads there: a fault-free run trains on the same samples.

The environment (set by ``tiny_gpt_torchft.sbatch`` with ``TORCHFT_GROUP_SIZE=2``):
``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS``, ``TORCHFT_LIGHTHOUSE``, ``MASTER_ADDR`` and
``MASTER_PORT`` (the group's store, on its rank 0's node), the rank in the group from
``RANK`` / ``WORLD_SIZE`` (or ``SLURM_PROCID`` / ``SLURM_NTASKS``), ``TORCHFT_RESTART``,
``TORCHFT_LOG_DIR``. The commit log is ``tiny_gpt_torchft.py``'s (``torchft-g<group>.jsonl``):
rank 0 of a group logs its commits, every rank its start (with ``"rank"``); the end is a line
``{"done": ...}`` with the group's mean loss and the full-state hash, and group 0's rank 0
prints tiny_gpt's ``throughput`` and ``done`` lines.

    srun -N2 -n2 ... python3 tiny_gpt_torchft_hsdp.py --mesh 2x2 --steps 24
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

# tiny_gpt.py and tiny_gpt_hsdp.py, whose model and data this drives, are the examples'; the
# other driver is beside this file.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sbatch-examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_gpt
import tiny_gpt_hsdp
import tiny_gpt_torchft
import torch
from torch import nn

#: Timeout of the group's own collectives (FSDP's all-gathers and reduce-scatters, seconds): a
#: rank whose peer in the group is gone fails within it, and its group restarts.
GROUP_TIMEOUT_S = 30.0
#: Timeout of the cross-group gloo group (train_ddp.py's 5 s, as tiny_gpt_torchft.py).
REPLICA_PG_TIMEOUT_S = 5.0
#: The Manager's timeout for its RPCs and collectives, and PGTransport's for a healing.
MANAGER_TIMEOUT_S = 30.0
HEAL_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class GroupPlace:
    """Where this process sits: replica group ``group`` of ``groups``, rank ``rank`` of ``shards``."""

    group: int
    groups: int
    rank: int
    shards: int
    restart: int

    @property
    def mesh_rank(self) -> int:
        """The rank in the ``groups x shards`` mesh (row-major): the data and dropout of that rank."""
        return self.group * self.shards + self.rank

    @property
    def world(self) -> int:
        return self.groups * self.shards

    @classmethod
    def from_env(cls, env: dict[str, str] | os._Environ[str]) -> GroupPlace:
        try:
            return cls(
                group=int(env["REPLICA_GROUP_ID"]),
                groups=int(env["NUM_REPLICA_GROUPS"]),
                rank=int(env.get("RANK", env.get("SLURM_PROCID", "0"))),
                shards=int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", "1"))),
                restart=int(env.get("TORCHFT_RESTART", "0")),
            )
        except KeyError as err:
            raise SystemExit(
                f"tiny_gpt_torchft_hsdp: {err.args[0]} is not set; start it with "
                "TORCHFT_GROUP_SIZE=2 sbatch tiny_gpt_torchft.sbatch"
            ) from None

    def check(self, layout: Any) -> None:
        """The mesh asked for (``--mesh RxS``) is the one the launcher started."""
        if tuple(layout.shape) != (self.groups, self.shards):
            raise SystemExit(
                f"tiny_gpt_torchft_hsdp: --mesh {'x'.join(map(str, layout.shape))} but the "
                f"launcher started {self.groups} groups of {self.shards} ranks"
            )


class ShardState:
    """The group's state as torchft moves it: this rank's shards of the parameters and the
    optimizer state, by reference (built once, while the parameters are sharded)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.params = dict(model.named_parameters())  # FSDP2's sharded DTensor parameters
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.params, "optim": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for name, value in state["model"].items():
                self.params[name].copy_(value)
        self.optimizer.load_state_dict(state["optim"])


def replicate_hook(manager: Any) -> Any:
    """FSDP's all-reduce hook: average the reduce-scattered gradient over the participating
    groups. A failed all-reduce is recorded by the Manager (the step is then not committed)."""

    def all_reduce(output: torch.Tensor) -> None:
        manager.allreduce(output).wait()

    return all_reduce


def set_replicate_hook(model: nn.Module, manager: Any) -> int:
    """Install the hook on every FSDP unit; how many there are."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_all_reduce_hook(replicate_hook(manager))
    return len(units)


def build_manager(place: GroupPlace, state: ShardState) -> Any:
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    pg = ProcessGroupGloo(timeout=timedelta(seconds=REPLICA_PG_TIMEOUT_S))
    return Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=state.load_state_dict,
        state_dict=state.state_dict,
        replica_id=f"tiny_gpt_hsdp_{place.group}",
        timeout=timedelta(seconds=MANAGER_TIMEOUT_S),
        checkpoint_transport=PGTransport(
            pg, timeout=timedelta(seconds=HEAL_TIMEOUT_S), device=torch.device("cpu")
        ),
        # Every group builds the same initial weights from the seed: torchft's docstring says to
        # set init_sync=False then. (Its default heals every non-primary replica at step 0, and
        # the primary is chosen per shard rank: each shard would train its first step on one
        # group's samples, averaged as if both had contributed.)
        init_sync=False,
        rank=place.rank,
        world_size=place.shards,
        store_addr=os.environ["MASTER_ADDR"],
        store_port=int(os.environ["MASTER_PORT"]),
        hostname=socket.gethostname(),
    )


def train(
    args: argparse.Namespace,
    place: GroupPlace,
    model: nn.Module,
    optimizer: Any,
    manager: Any,
    log: tiny_gpt_torchft.CommitLog,
) -> tuple[torch.Tensor, tiny_gpt.Throughput]:
    """The torchft loop: quorum at zero_grad, FSDP + the hook in backward, commit at step."""
    meter = tiny_gpt.Throughput(args, place.mesh_rank, place.world)
    loss = torch.tensor(float("nan"))
    while manager.current_step() < args.steps:
        optimizer.zero_grad()  # starts the quorum (asynchronously, overlapping the forward)
        step = manager.current_step()
        if args.step_sleep:
            time.sleep(args.step_sleep)  # part of the step's compute, as in tiny_gpt.py
        loss = tiny_gpt.loss_of(args, model, step, place.mesh_rank, place.world)
        optimizer.step()  # should_commit: applied only if every rank of every participant agrees
        done = manager.current_step()
        if done <= step:
            if place.rank == 0:
                log.write({"event": "not committed", "step": step, "quorum": manager._quorum_id})
            continue
        meter.commit(done)
        if place.rank == 0:
            log.write(
                {"step": done, "quorum": manager._quorum_id, "participants": manager.num_participants()}
            )
        if place.mesh_rank == 0 and (done % args.log_every == 0 or done == args.steps):
            print(f"step={done} loss={float(loss.detach()):.4f}", flush=True)
    return loss, meter


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchft import Optimizer

    args, own = tiny_gpt_hsdp.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*find_unused_parameters=True.*")
    place = GroupPlace.from_env(os.environ)
    place.check(own.mesh)
    folder = Path(os.environ.get("TORCHFT_LOG_DIR", "."))
    log = tiny_gpt_torchft.CommitLog(folder, place.group, place.restart)

    # The group's world: its store on rank 0's node (MASTER_ADDR), which the Manager shares and
    # other groups reach when the quorum picks it for the cross-group process groups.
    dist.init_process_group(
        "gloo", rank=place.rank, world_size=place.shards, timeout=timedelta(seconds=GROUP_TIMEOUT_S)
    )
    mesh = init_device_mesh("cpu", (place.shards,), mesh_dim_names=("shard",))
    model, opt = tiny_gpt_hsdp.builder(args)(mesh)  # identical initial weights in every group
    state = ShardState(model, opt)
    manager = build_manager(place, state)
    set_replicate_hook(model, manager)
    optimizer = Optimizer(manager, opt)
    if place.restart == 0:
        tiny_gpt_torchft.start_barrier(folder, place.group, place.groups)
    log.write(
        {"event": "start", "rank": place.rank, "node": socket.gethostname(), "step": manager.current_step()}
    )

    loss, meter = train(args, place, model, optimizer, manager, log)
    final_loss = tiny_gpt.mean_over_ranks(loss, place.shards)  # over the group's ranks
    digest = tiny_gpt_hsdp.full_state_sha256(model, opt)  # collective in the group; rank 0 gets it
    if place.rank == 0:
        log.write(
            {
                "done": args.steps,
                "loss": round(final_loss, 4),
                "params_sha256": digest,
                "throughput": meter.line(),
            }
        )
        (folder / f"torchft-done-{place.group}").touch()  # the launcher's sign that the group finished
    if place.mesh_rank == 0:
        print(meter.line(), flush=True)
        print(f"done step={args.steps} loss={final_loss:.4f} params_sha256={digest}", flush=True)
    manager.shutdown(wait=False)
    # No destroy_process_group() (tiny_gpt.plain_main: gloo hangs now and then when the store's
    # rank goes first): a barrier, then the process ends and the group with it.
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
