#!/usr/bin/env python3
"""The tiny GPT of tiny_gpt.py trained with HSDP (FSDP2 ``fully_shard`` on a 2-D mesh) or pure FSDP.

The model, the data and the loss are tiny_gpt.py's (one implementation, two drivers); this
script shards them with :class:`~torchpass_slurm.train.ShardedTrainer`::

    --mesh 2x2    4 ranks: 2 replica groups ("replicate") of 2 shards ("shard"): HSDP
    --mesh 1x4    4 ranks, one group of 4 shards: pure FSDP (no replica: only a planned
                  drain migrates live; a lost rank restarts from the shard checkpoint)

Every transformer block is one FSDP unit, the embeddings and the head the root's. The data
position is tiny_gpt's, a function of (seed, step, rank), or with ``--loader stateful`` a
per-rank :class:`tiny_gpt.FilteredLoader` whose position only its state says: it is the
trainer's ``rank_state``, which a spare receives from the supervisor. ``--sample-log DIR``
appends every committed step's sample ids to ``DIR/samples-rank<R>.jsonl`` (one file per
logical rank, written by whichever process holds the rank), to compare runs sample by sample.
Checkpoints (``--ckpt-every``) are per-rank shard files (``rank/shard_checkpoint.py``). The last line,
``done step=<N> loss=<x> params_sha256=<hash>``, hashes the full parameters AND the full
optimizer state, gathered once at the end, so a migrated run can be compared with a
fault-free one.

    python3 tiny_gpt_hsdp.py --mesh 2x2 --steps 50 --ckpt-every 10 --ckpt-dir /tmp/ckpt
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_gpt  # the model, data and CLI of the DDP example (it finds torchpass_slurm in a checkout)
import torch
from torch import nn

from torchpass_slurm.train import MeshLayout, Runtime, ShardedTrainer, leave


def mesh_layout(text: str) -> MeshLayout:
    """``RxS`` -> R replica groups of S shards; ``1xS`` is pure FSDP (no replicate dimension)."""
    try:
        replicas, shards = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh is REPLICASxSHARDS (2x2, 1x4); got {text!r}") from None
    if replicas == 1:
        return MeshLayout(("shard",), (shards,), replicate=None)
    return MeshLayout(("replicate", "shard"), (replicas, shards))


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--mesh",
        type=mesh_layout,
        default=mesh_layout("2x2"),
        help="REPLICASxSHARDS (default 2x2: HSDP; 1x4: pure FSDP)",
    )
    p.add_argument(
        "--loader",
        choices=("step", "stateful"),
        default="step",
        help="step: the data position is the step (default); stateful: a filtered "
        "per-rank stream whose position is rank state",
    )
    p.add_argument(
        "--sample-log",
        type=Path,
        help="append each committed step's sample ids here "
        "(DIR/samples-rank<R>.jsonl; a relative DIR is in $TORCHPASS_RUN_DIR when set)",
    )
    known, rest = p.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        p.print_help()
    return tiny_gpt.parse_args(rest), known


def builder(args: argparse.Namespace) -> Any:
    """build(mesh): tiny_gpt's model and optimizer, every block and the root sharded on ``mesh``."""
    from torch.distributed.fsdp import fully_shard

    def build(mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(args.seed)  # identical initial weights on every rank, every epoch
        model = tiny_gpt.TinyGPT(
            args.vocab, args.d_model, args.n_layers, args.n_heads, args.context, args.dropout
        )
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    return build


def full_state_sha256(model: nn.Module, optimizer: torch.optim.Optimizer) -> str | None:
    """SHA-256 of the full parameters and optimizer state (gathered once, collective), on rank 0."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    params = get_model_state_dict(model, options=options)
    optim = get_optimizer_state_dict(model, optimizer, options=options)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    h = hashlib.sha256()
    for name, value in sorted(params.items()):
        h.update(name.encode())
        h.update(tiny_gpt.tensor_bytes(value))
    for fqn, per_param in sorted(optim["state"].items()):
        for key, value in sorted(per_param.items()):
            h.update(f"{fqn}/{key}".encode())
            is_tensor = isinstance(value, torch.Tensor)
            h.update(tiny_gpt.tensor_bytes(value) if is_tensor else repr(value).encode())
    return h.hexdigest()


def log_samples(folder: Path, rank: int, step: int, ids: list[int]) -> None:
    """One line per committed step of this logical rank: ``{"step": S, "ids": [...]}``."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"samples-rank{rank}.jsonl", "a") as f:
        f.write(json.dumps({"step": step, "ids": ids}) + "\n")


def main(argv: list[str] | None = None) -> int:
    args, own = parse_args(argv)
    layout: MeshLayout = own.mesh
    run_dir = os.environ.get("TORCHPASS_RUN_DIR")
    if own.sample_log is not None and not own.sample_log.is_absolute() and run_dir:
        own.sample_log = Path(run_dir) / own.sample_log
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    rt = Runtime.from_env()
    rt.start()  # a spare blocks here until promoted (the mesh needs the group: it builds after)
    world, rank = rt.world_size, rt.rank
    if world != layout.world_size:
        raise SystemExit(
            f"--mesh {'x'.join(map(str, layout.shape))} needs {layout.world_size} ranks; this job has {world}"
        )
    loader = None
    if own.loader == "stateful":
        loader = tiny_gpt.FilteredLoader(args.seed, rank, world, args.batch_size, args.context, args.vocab)
    trainer = ShardedTrainer(rt, builder(args), layout, rank_state={"data": loader} if loader else None)
    trainer.start()  # joins the group, builds the mesh and the model; a live spare receives here
    ckpt_dir = tiny_gpt.checkpoint_dir(args)
    if trainer.resume_from_checkpoint(ckpt_dir) and not trainer.received_state:
        rt.log.info("resumed at step %d from %s", trainer.step, ckpt_dir)
    if rank == 0:
        rt.log.info(
            "model: %d parameters, mesh %s",
            sum(p.numel() for p in trainer.model.parameters()),
            dict(zip(layout.dims, layout.shape, strict=True)),
        )
    meter = tiny_gpt.Throughput(args, rank, world)
    hang = tiny_gpt.HangInjection(rt.log) if args.hang_on_sigusr1 else None

    def train_step(step: int, model: nn.Module) -> torch.Tensor:
        if hang is not None:
            hang.maybe_hang(step)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if loader is None:
            return tiny_gpt.loss_of(args, model, step, rank, world)  # FSDP reduce-scatters in backward
        torch.manual_seed(args.seed * 7919 + rank * 104_729 + step)  # dropout: (seed, rank, step)
        x, y = loader.next_batch()
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, args.vocab), y.reshape(-1))
        loss.backward()
        return loss

    def on_commit(done: int, loss: torch.Tensor) -> None:
        meter.commit(done)
        if own.sample_log is not None:
            log_samples(own.sample_log, rank, done, loader.last_ids if loader else [])
        if done % args.log_every == 0 or done == args.steps:
            mean = tiny_gpt.mean_over_ranks(loss, world)
            if rank == 0:
                print(f"step={done} loss={mean:.4f}", flush=True)
        if ckpt_dir and args.ckpt_every and done % args.ckpt_every == 0:
            trainer.save_checkpoint(ckpt_dir, done, keep=args.ckpt_keep)
        if args.fail_at_step is not None and done == args.fail_at_step:
            rt.log.warning("fault injection: exiting at step %d", done)
            sys.stdout.flush()
            os._exit(17)

    loss = trainer.fit(train_step, args.steps, on_commit)
    if trainer.released:  # this node is being drained; the spare carries on with its shards
        rt.close()
        return 0
    final_loss = tiny_gpt.mean_over_ranks(loss if loss is not None else torch.tensor(float("nan")), world)
    digest = full_state_sha256(trainer.model, trainer.optimizer)
    if rank == 0:
        print(meter.line(), flush=True)
        print(f"done step={args.steps} loss={final_loss:.4f} params_sha256={digest}", flush=True)
    trainer.close()
    rt.close()
    return 0


if __name__ == "__main__":
    leave(main())  # not sys.exit: torch's gloo threads may abort the interpreter's shutdown
