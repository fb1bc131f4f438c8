#!/usr/bin/env python3
"""The smallest DDP training under torchpass-slurm: the lines marked ``# torchpass`` are all
that differ from a plain DDP loop (docs/user-guide-training.md explains each).

Runs as any DDP script (``torchrun``, ``srun``) and under ``tp run`` (minimal.sbatch), where a
hot spare takes a lost rank's place live. STEPS (default 200) and CKPT_EVERY (default 50)
come from the environment; checkpoints go to $TORCHPASS_RUN_DIR/checkpoints when it is set.
"""

import os
from pathlib import Path

import torch
from torch import nn

from torchpass_slurm.train import ElasticTrainer, Runtime, checkpoint, leave  # torchpass

STEPS = int(os.environ.get("STEPS", "200"))
CKPT_EVERY = int(os.environ.get("CKPT_EVERY", "50"))
RUN_DIR = os.environ.get("TORCHPASS_RUN_DIR")
CKPT_DIR = Path(RUN_DIR) / "checkpoints" if RUN_DIR else None


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data is a function of (step, rank): a spare in rank r's place reads what r would."""
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(step * world + rank))
    return x, x.sum(dim=1, keepdim=True)


def main() -> int:
    rt = Runtime.from_env()  # torchpass: reads the environment and connects; never blocks
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rt.start()  # torchpass: a hot spare waits here, its model built, until promoted
    rank, world = rt.rank, rt.world_size
    state = {"train": checkpoint.TrainState(model, opt)}  # torchpass: what a spare receives
    trainer = ElasticTrainer(rt, model, opt, state=state)  # torchpass: instead of DDP(model)
    trainer.start()  # torchpass: the process group; a spare promoted live gets the state here
    trainer.resume_from_checkpoint(CKPT_DIR)  # torchpass: unless the state came live

    def train_step(step: int, ddp: nn.Module) -> torch.Tensor:  # no zero_grad, no opt.step()
        x, y = batch(step, rank, world)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()  # DDP all-reduces the gradients here: the step's commit point
        return loss

    def on_commit(done: int, loss: torch.Tensor) -> None:  # the step counts: log, checkpoint
        if rank == 0 and done % 10 == 0:
            print(f"step={done} loss={loss.item():.4f}", flush=True)
        if CKPT_DIR and done % CKPT_EVERY == 0:
            checkpoint.save(state, CKPT_DIR, done)

    trainer.fit(train_step, STEPS, on_commit)  # torchpass: the loop, with the optimizer step
    trainer.close()
    rt.close()
    return 0


if __name__ == "__main__":
    leave(main())  # torchpass: exit without torch's teardown, which may abort at shutdown
