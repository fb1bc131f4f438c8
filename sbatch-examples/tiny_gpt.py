#!/usr/bin/env python3
"""A tiny GPT trained with DDP over gloo on CPU: the example job of torchpass-slurm.

A decoder-only transformer (default 4 layers, d_model 256, 4 heads, context 64,
vocab 256; about 3.2 M parameters) learns the next token of synthetic,
deterministic sequences: each sequence counts up modulo 256 with its own stride
(1, 2, 3 or 5), and 10 % of the tokens are replaced by noise. The model has to
read the stride from the context, so the loss really falls (from ln 256 = 5.5
towards the noise floor, about 1).

Everything is a function of ``--seed``, the step and the rank: sample ``i`` of
the (infinite) data set is generated from ``seed`` and ``i``; step ``s`` of
rank ``r`` reads samples ``s*B*W + r*B ... + B-1`` (B = --batch-size, W = world
size), so the data position is the step. Together with the checkpointed model,
optimizer and per-rank RNG states, a run that is interrupted and resumed ends
with bitwise the same parameters as an uninterrupted one; the last line says
so: ``done step=<N> loss=<x> params_sha256=<hash>``.

Runs the same under ``tp run`` (torchpass-slurm), plain ``srun`` and
``torchrun``: the rank comes from :class:`torchpass_slurm.train.Runtime`. With a
world size of 1 it trains without a process group.

    python3 tiny_gpt.py --steps 50 --ckpt-every 10 --ckpt-dir /tmp/ckpt
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
import os
import signal
import sys
import time
import warnings
from pathlib import Path

try:
    from torchpass_slurm.train import ElasticTrainer, Runtime, checkpoint, leave
except ImportError:  # running from a source checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from torchpass_slurm.train import ElasticTrainer, Runtime, checkpoint, leave

import torch
import torch.nn as nn
import torch.nn.functional as F

log = logging.getLogger("tiny_gpt")

STRIDES = (1, 2, 3, 5)
NOISE = 0.1


# --- model -------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, d_model: int, n_heads: int, context: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.drop = nn.Dropout(dropout)
        mask = torch.tril(torch.ones(context, context, dtype=torch.bool))
        self.register_buffer("mask", mask, persistent=False)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.n_heads)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(dim=-1)
        y = (self.drop(att) @ v).transpose(1, 2).reshape(b, t, d)
        return self.drop(self.proj(y))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyGPT(nn.Module):
    """Token + position embeddings, ``n_layers`` blocks, a final norm and an LM head."""

    def __init__(
        self, vocab: int, d_model: int, n_layers: int, n_heads: int, context: int, dropout: float
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, context, dropout) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


# --- data ----------------------------------------------------------------------------


def sample(seed: int, index: int, length: int, vocab: int) -> torch.Tensor:
    """Sample ``index`` of the data set: ``length`` tokens counting up with a stride, plus noise."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    stride = STRIDES[int(torch.randint(len(STRIDES), (1,), generator=g))]
    start = int(torch.randint(vocab, (1,), generator=g))
    seq = (start + stride * torch.arange(length)) % vocab
    noisy = torch.rand(length, generator=g) < NOISE
    return torch.where(noisy, torch.randint(vocab, (length,), generator=g), seq)


def batch(
    seed: int, step: int, rank: int, world: int, batch_size: int, context: int, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of ``rank`` at ``step`` (explicit, DistributedSampler-like sharding)."""
    first = (step * world + rank) * batch_size
    rows = torch.stack([sample(seed, first + i, context + 1, vocab) for i in range(batch_size)])
    return rows[:, :-1], rows[:, 1:]


class FilteredLoader:
    """A stateful per-rank loader, as a real data pipeline is: rank ``r`` reads its own stream
    (samples ``r``, ``r + W``, ``r + 2W``, ...) and a quality filter drops about one sample in
    four by its content, so how far a rank has read after k steps is not a function of k. Only
    :meth:`state_dict` says where it is: no replica holds it, and a spare that takes the rank
    must get it (``ElasticTrainer(rank_state=...)``). Its state is JSON: ``{"position": n}``."""

    def __init__(self, seed: int, rank: int, world: int, batch_size: int, context: int, vocab: int) -> None:
        self.seed, self.rank, self.world = seed, rank, world
        self.batch_size, self.context, self.vocab = batch_size, context, vocab
        self.position = 0  # how many samples of this rank's stream were read (kept or dropped)
        self.last_ids: list[int] = []  # the samples of the last batch, in order

    @staticmethod
    def keep(row: torch.Tensor) -> bool:
        return int(row.sum()) % 4 != 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows, ids = [], []
        while len(rows) < self.batch_size:
            index = self.rank + self.world * self.position
            self.position += 1
            row = sample(self.seed, index, self.context + 1, self.vocab)
            if self.keep(row):
                rows.append(row)
                ids.append(index)
        self.last_ids = ids
        stacked = torch.stack(rows)
        return stacked[:, :-1], stacked[:, 1:]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


# --- helpers -------------------------------------------------------------------------


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor (numpy is fast; the storage fallback is slow but works)."""
    t = t.cpu().contiguous()
    try:
        return t.numpy().tobytes()
    except (RuntimeError, TypeError):  # numpy not installed
        return bytes(t.clone().view(torch.uint8).untyped_storage())


def params_sha256(model: nn.Module) -> str:
    """SHA-256 of every parameter's bytes, in name order: equal iff the weights are bitwise equal."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(tensor_bytes(p.detach()))
    return h.hexdigest()


def optim_sha256(opt: torch.optim.Optimizer) -> str:
    """SHA-256 of the optimizer's state tensors (moments, step counts), in parameter order."""
    h = hashlib.sha256()
    for index, param_state in sorted(opt.state_dict()["state"].items()):
        for key, value in sorted(param_state.items()):
            h.update(f"{index}/{key}".encode())
            h.update(tensor_bytes(value) if isinstance(value, torch.Tensor) else repr(value).encode())
    return h.hexdigest()


def mean_over_ranks(value: torch.Tensor, world: int) -> float:
    if world > 1:
        import torch.distributed as dist

        value = value.detach().clone()
        dist.all_reduce(value)
        value /= world
    return float(value.detach())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50, help="total optimizer steps (default 50)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step (default 8)")
    p.add_argument(
        "--ckpt-every", type=int, default=10, help="checkpoint every N steps; 0 = never (default 10)"
    )
    p.add_argument(
        "--ckpt-dir",
        default=None,
        help="checkpoint folder (default $TORCHPASS_RUN_DIR/checkpoints; none if unset)",
    )
    p.add_argument("--ckpt-keep", type=int, default=3, help="checkpoints to keep (default 3)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--step-sleep", type=float, default=0.0, help="sleep seconds per step, to stretch a run")
    p.add_argument("--log-every", type=int, default=10, help="print the loss every N steps (rank 0)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument(
        "--threads",
        type=int,
        default=int(os.environ.get("SLURM_CPUS_PER_TASK", "1")),
        help="torch CPU threads (default $SLURM_CPUS_PER_TASK or 1; results depend on it)",
    )
    p.add_argument(
        "--fail-at-step",
        type=int,
        default=None,
        help="fault injection: exit with status 17 once this many steps are done",
    )
    p.add_argument(
        "--hang-on-sigusr1",
        action="store_true",
        help="fault injection: after SIGUSR1 the training thread hangs at its next step for good "
        "while its heartbeat thread goes on (a rank stuck in its data loader)",
    )
    p.add_argument(
        "--plain-ddp",
        action="store_true",
        help="train with plain torch DDP, without torchpass (the baseline of the benchmarks)",
    )
    p.add_argument(
        "--warmup-steps", type=int, default=3, help="steps left out of the throughput line (default 3)"
    )
    return p.parse_args(argv)


def checkpoint_dir(args: argparse.Namespace) -> Path | None:
    if args.ckpt_dir:
        return Path(args.ckpt_dir)
    run_dir = os.environ.get("TORCHPASS_RUN_DIR")
    return Path(run_dir) / "checkpoints" if run_dir else None


# --- training --------------------------------------------------------------------------


class Throughput:
    """Tokens per second over the steps after the warm-up, printed by rank 0 at the end."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.tokens_per_step = args.batch_size * args.context * world
        self.warmup = args.warmup_steps
        self.first: tuple[int, float] | None = None
        self.last: tuple[int, float] | None = None

    def commit(self, done: int) -> None:
        now = time.perf_counter()
        if done >= self.warmup and self.first is None:
            self.first = (done, now)
        self.last = (done, now)

    def line(self) -> str:
        if self.first is None or self.last is None or self.last[0] <= self.first[0]:
            return "throughput unknown (no step after the warm-up)"
        steps, seconds = self.last[0] - self.first[0], self.last[1] - self.first[1]
        return (
            f"throughput steps={steps} seconds={seconds:.3f} "
            f"tokens_per_s={steps * self.tokens_per_step / seconds:.1f}"
        )


def after_step(
    args: argparse.Namespace,
    done: int,
    loss: torch.Tensor,
    meter: Throughput,
    state: dict[str, checkpoint.TrainState],
    ckpt_dir: Path | None,
) -> None:
    """After a committed step: time it, print the loss every --log-every steps, checkpoint."""
    meter.commit(done)
    if done % args.log_every == 0 or done == args.steps:
        mean = mean_over_ranks(loss, meter.world)
        if meter.rank == 0:
            print(f"step={done} loss={mean:.4f}", flush=True)
    if ckpt_dir and args.ckpt_every and done % args.ckpt_every == 0:
        checkpoint.save(state, ckpt_dir, done, keep=args.ckpt_keep)


def print_end(
    args: argparse.Namespace,
    loss: torch.Tensor,
    meter: Throughput,
    model: nn.Module,
    opt: torch.optim.Optimizer,
) -> None:
    """Rank 0's last lines: the throughput, then the final loss and the hashes of the state."""
    final_loss = mean_over_ranks(loss, meter.world)
    if meter.rank == 0:
        print(meter.line(), flush=True)
        print(
            f"done step={args.steps} loss={final_loss:.4f} params_sha256={params_sha256(model)} "
            f"optim_sha256={optim_sha256(opt)}",
            flush=True,
        )


def build(args: argparse.Namespace) -> tuple[TinyGPT, torch.optim.Optimizer]:
    """The model and optimizer, identical on every rank (same seed)."""
    torch.manual_seed(args.seed)
    model = TinyGPT(args.vocab, args.d_model, args.n_layers, args.n_heads, args.context, args.dropout)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)


def loss_of(args: argparse.Namespace, model: nn.Module, step: int, rank: int, world: int) -> torch.Tensor:
    """Forward and backward of one step; DDP all-reduces the gradients in backward."""
    # Per-rank randomness (dropout) is a function of (seed, rank, step), so a
    # spare that takes over a rank draws exactly what the lost rank would have.
    torch.manual_seed(args.seed * 7919 + rank * 104_729 + step)
    x, y = batch(args.seed, step, rank, world, args.batch_size, args.context, args.vocab)
    loss = F.cross_entropy(model(x).reshape(-1, args.vocab), y.reshape(-1))
    loss.backward()
    return loss


def plain_main(args: argparse.Namespace) -> int:
    """The same training with torch DDP alone: what a job without fault tolerance runs.

    Rank and world come from Slurm (``SLURM_PROCID``, ``SLURM_NTASKS``) or
    torchrun (``RANK``, ``WORLD_SIZE``); the rendezvous from ``MASTER_ADDR`` /
    ``MASTER_PORT``. It resumes from the newest checkpoint in ``--ckpt-dir``,
    so a requeued job carries on from there (and recomputes the steps since).
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    model, opt = build(args)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        ddp: nn.Module = DDP(model)
    else:
        ddp = model
    state = {"train": checkpoint.TrainState(model, opt)}
    ckpt_dir = checkpoint_dir(args)
    start = (checkpoint.load_latest(state, ckpt_dir) if ckpt_dir else None) or 0
    if rank == 0:
        print(
            f"model: {sum(p.numel() for p in model.parameters())} parameters, world size {world}, "
            f"plain DDP, starting at step {start}",
            flush=True,
        )
    meter = Throughput(args, rank, world)
    loss = torch.tensor(float("nan"))
    for step in range(start, args.steps):
        opt.zero_grad(set_to_none=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        loss = loss_of(args, ddp, step, rank, world)
        opt.step()
        done = step + 1
        after_step(args, done, loss, meter, state, ckpt_dir)
    print_end(args, loss, meter, model, opt)
    if world > 1:
        # No destroy_process_group(): with gloo it hangs now and then when rank 0,
        # which hosts the store, is gone first (pytorch/pytorch#75097). A barrier,
        # then the process ends and the group with it.
        dist.barrier()
    return 0


class HangInjection:
    """``--hang-on-sigusr1``: SIGUSR1 asks the training thread to hang at its next step.

    The signal only sets a flag (Python runs handlers in the main thread, between two
    bytecodes: anywhere in the step). The step then hangs where a stuck data loader would,
    before its forward, in Python; the heartbeat thread goes on, so only the lack of
    progress shows it.
    """

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self.requested = False
        signal.signal(signal.SIGUSR1, self._request)

    def _request(self, signum: int, frame: object) -> None:
        self.requested = True

    def maybe_hang(self, step: int) -> None:
        if not self.requested:
            return
        self.log.warning("fault injection: the training thread hangs before step %d (SIGUSR1)", step)
        while True:
            time.sleep(3600)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    # The DDP bucket layout must not depend on where the run started (see ElasticTrainer).
    warnings.filterwarnings("ignore", message=".*find_unused_parameters=True.*")
    if args.plain_ddp:
        return plain_main(args)

    # Build everything before joining: a hot spare waits in rt.start() with its model built.
    rt = Runtime.from_env()
    model, opt = build(args)  # identical initial weights on every rank
    rt.start()  # a spare blocks here until promoted
    world, rank = rt.world_size, rt.rank
    if rank == 0:
        rt.log.info("model: %d parameters, world size %d", sum(p.numel() for p in model.parameters()), world)

    state = {"train": checkpoint.TrainState(model, opt)}
    trainer = ElasticTrainer(rt, model, opt, state=state)
    trainer.start()  # joins the group; a spare promoted live receives the state here
    ckpt_dir = checkpoint_dir(args)
    if trainer.resume_from_checkpoint(ckpt_dir) and not trainer.received_state:
        rt.log.info("resumed at step %d from %s", trainer.step, ckpt_dir)

    meter = Throughput(args, rank, world)
    hang = HangInjection(rt.log) if args.hang_on_sigusr1 else None

    def train_step(step: int, ddp_model: nn.Module) -> torch.Tensor:
        if hang is not None:
            hang.maybe_hang(step)
        if args.step_sleep:
            time.sleep(args.step_sleep)  # part of the step's compute, before the forward
        return loss_of(args, ddp_model, step, rank, world)  # backward is the commit point

    def on_commit(done: int, loss: torch.Tensor) -> None:
        after_step(args, done, loss, meter, state, ckpt_dir)
        if args.fail_at_step is not None and done == args.fail_at_step:
            rt.log.warning("fault injection: exiting at step %d", done)
            sys.stdout.flush()
            os._exit(17)

    loss = trainer.fit(train_step, args.steps, on_commit)
    if trainer.released:  # this node is being drained; a spare carries on with the state
        rt.close()
        return 0
    print_end(args, loss if loss is not None else torch.tensor(float("nan")), meter, model, opt)
    trainer.close()
    rt.close()
    return 0


if __name__ == "__main__":
    leave(main())  # not sys.exit: torch's gloo threads may abort the interpreter's shutdown
