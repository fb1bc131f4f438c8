"""Does DDP stay bitwise deterministic across a re-wrap, for which keyword arguments, and at what cost?

    python -m benchmarks.experiments.ddp_determinism            # 30 steps, a shrunk example model (1-2 min)
    python -m benchmarks.experiments.ddp_determinism --quick    # 8 steps, smaller model: checks that it works

``ElasticTrainer`` wraps the model in a DDP and, after every live migration,
in a fresh DDP on the new epoch's process group; the project's oracle is that
the final parameters and optimizer state are bitwise those of a fault-free
run. A gloo all-reduce sums an element in an order that depends on where the
element sits in the flattened bucket (its ring segment), so a bucket layout
that differs after a re-wrap can change the low bits. DDP lays the buckets out
in reverse parameter order at construction and, unless
``find_unused_parameters=True``, puts every parameter in one bucket for the
first iteration and rebuilds the buckets in gradient-ready order before the
second (``Reducer::should_rebuild_buckets``): the first step after a re-wrap
then runs on another layout than the same step of a run that was never
re-wrapped.

Three processes form a gloo group on 127.0.0.1 (the TCPStore is hosted here,
as ``tp run`` hosts it) and train ``sbatch-examples/tiny_gpt.py``'s model on
its own data and per-rank dropout seeds, with AdamW, for ``--steps`` steps in
three ways per DDP configuration:

====  ======================================================================
(a)   one DDP wrap from step 0 to the end
(b)   the same processes, re-wrapped in a fresh DDP at 1/3 and 2/3 of the run,
      each time on a fresh process group (destroy, then init under a new store
      prefix), as ``ElasticTrainer`` does after a migration
(c)   fresh processes that load the model and optimizer state (b) saved at
      1/3 of the run and train on from there in a new group
====  ======================================================================

It prints, per configuration, whether the SHA-256 of the final parameters and
of the optimizer state agree between (a), (b) and (c), the first step whose
parameters differ and how many parameter elements differ at the end. The
time per step comes from a separate phase in the same processes, one group,
one model per configuration, the configurations taking turns (round robin)
so that drift of the machine spreads over all of them: the median of the
steady-state steps (after the bucket rebuild). A script, not a test: the
times depend on the machine; the hashes must not.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import inspect
import multiprocessing as mp
import os
import queue
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

WORLD = 3
EXAMPLE = Path(__file__).resolve().parents[2] / "sbatch-examples" / "tiny_gpt.py"
#: How long a worker may take for its whole share before the parent gives up on it.
WORKER_TIMEOUT_S = 300.0
#: Timeout of every collective and rendezvous in the workers.
PG_TIMEOUT = datetime.timedelta(seconds=60)

#: The DDP keyword arguments compared. "per_param" exists only where DDP has
#: ``bucket_cap_mb_list`` (not in torch 2.6): one parameter per bucket, at
#: construction and after the rebuild, so no element moves within its bucket.
CONFIGS: dict[str, dict[str, Any]] = {
    "find_unused": {"find_unused_parameters": True},
    "defaults": {},
    "static_graph": {"static_graph": True},
    "one_bucket": {"bucket_cap_mb": 1024},
    "bucket_view": {"gradient_as_bucket_view": True},
    "per_param": {"bucket_cap_mb_list": [1e-6]},
}


@dataclass(frozen=True)
class Plan:
    """What every worker runs: the model's size, the steps, where the re-wraps fall."""

    steps: int
    model_args: tuple[str, ...]
    rewrap_at: tuple[int, ...]
    timing_rounds: int
    timing_steps: int

    @property
    def resume_at(self) -> int:
        return self.rewrap_at[0]


@dataclass
class Outcome:
    """One (configuration, way) from rank 0: the final hashes, per-step hashes, the flat params."""

    params_sha256: str
    optim_sha256: str
    step_sha256: list[str]
    flat: Any  # numpy array of every parameter, name order
    ranks_agree: bool = True


@dataclass
class Row:
    name: str
    kwargs: dict[str, Any]
    ways: dict[str, Outcome] = field(default_factory=dict)
    step_s: float | None = None


# --- the model: sbatch-examples/tiny_gpt.py's own ------------------------------------


def load_example() -> ModuleType:
    """Import tiny_gpt.py as a module (it runs nothing at import: its main is behind __name__)."""
    spec = importlib.util.spec_from_file_location("tiny_gpt", EXAMPLE)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {EXAMPLE}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def supported(kwargs: Mapping[str, Any]) -> bool:
    """True when this torch's DDP takes every keyword of ``kwargs``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return set(kwargs) <= set(inspect.signature(DDP.__init__).parameters)


def params_hash(model: Any, gpt: ModuleType) -> str:
    return str(gpt.params_sha256(model))


def flat_params(model: Any) -> Any:
    import torch

    return torch.cat([p.detach().flatten() for _, p in sorted(model.named_parameters())]).numpy().copy()


# --- the workers ---------------------------------------------------------------------


class Worker:
    """One rank: its store connection, the example module, and a group it can rebuild."""

    def __init__(self, rank: int, port: int, label: str) -> None:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        self.rank, self.label, self.groups = rank, label, 0
        self.store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=PG_TIMEOUT)
        self.gpt = load_example()

    def join(self) -> None:
        """A fresh default group under a prefix of its own, as a new epoch's."""
        import torch.distributed as dist

        self.groups += 1
        store = dist.PrefixStore(f"{self.label}/g{self.groups}", self.store)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=WORLD, timeout=PG_TIMEOUT)

    def leave(self) -> None:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()

    def build(self, plan: Plan) -> tuple[argparse.Namespace, Any, Any]:
        args = self.gpt.parse_args(list(plan.model_args))
        model, opt = self.gpt.build(args)
        return args, model, opt

    def step(self, args: argparse.Namespace, ddp: Any, opt: Any, step: int) -> float:
        """One training step as ElasticTrainer runs it; its seconds."""
        started = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        self.gpt.loss_of(args, ddp, step, self.rank, WORLD)
        opt.step()
        return time.perf_counter() - started


def train(
    w: Worker,
    plan: Plan,
    kwargs: Mapping[str, Any],
    start: int,
    rewrap_at: tuple[int, ...],
    save: Callable[[int, Any, Any], None] | None = None,
    load: Callable[[Any, Any], None] | None = None,
) -> Outcome:
    """Train steps ``start`` .. ``plan.steps - 1``, re-wrapping before each step of ``rewrap_at``."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    args, model, opt = w.build(plan)
    if load is not None:
        load(model, opt)
    w.join()
    ddp, hashes = DDP(model, **kwargs), []
    for step in range(start, plan.steps):
        if step in rewrap_at:
            if save is not None:
                save(step, model, opt)
            del ddp  # ElasticTrainer drops its wrapper before the group goes
            w.leave()
            w.join()
            ddp = DDP(model, **kwargs)
        w.step(args, ddp, opt, step)
        hashes.append(params_hash(model, w.gpt))
    outcome = Outcome(params_hash(model, w.gpt), str(w.gpt.optim_sha256(opt)), hashes, flat_params(model))
    mine = [outcome.params_sha256, outcome.optim_sha256]
    everyone: list[Any] = [None] * WORLD
    dist.all_gather_object(everyone, mine)
    outcome.ranks_agree = all(h == mine for h in everyone)
    del ddp
    w.leave()
    return outcome


def time_configs(w: Worker, plan: Plan, names: list[str]) -> dict[str, float]:
    """Median seconds per steady-state step of each configuration, taking turns in one group."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    w.join()
    runs = {}
    for name in names:
        args, model, opt = w.build(plan)
        ddp = DDP(model, **CONFIGS[name])
        for step in range(3):  # warm-up: the bucket rebuild happens before the second step
            w.step(args, ddp, opt, step)
        runs[name] = (args, ddp, opt)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(plan.timing_rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            args, ddp, opt = runs[name]
            for step in range(plan.timing_steps):
                times[name].append(w.step(args, ddp, opt, 3 + r * plan.timing_steps + step))
    runs.clear()
    w.leave()
    return {name: statistics.median(t) for name, t in times.items()}


def worker_rewrap(rank: int, port: int, plan: Plan, kwargs: dict[str, Any], out: Any) -> None:
    """Ways (a) and (b) for one set of DDP keyword arguments; rank 0 reports."""
    w = Worker(rank, port, "rewrap")
    a = train(w, plan, kwargs, 0, ())
    b = train(w, plan, kwargs, 0, plan.rewrap_at)
    if rank == 0:
        out.put(("way", "kwargs", "a", a))
        out.put(("way", "kwargs", "b", b))


def worker_ab(rank: int, port: int, plan: Plan, names: list[str], state_dir: str, out: Any) -> None:
    """Ways (a) and (b) for every configuration, then the timing phase; rank 0 reports."""
    import torch

    w = Worker(rank, port, "ab")

    def saver(name: str) -> Callable[[int, Any, Any], None]:
        def save(step: int, model: Any, opt: Any) -> None:
            if rank == 0 and step == plan.resume_at:
                blob = {"model": model.state_dict(), "optim": opt.state_dict()}
                torch.save(blob, os.path.join(state_dir, f"{name}.pt"))

        return save

    for name in names:
        a = train(w, plan, CONFIGS[name], 0, ())
        b = train(w, plan, CONFIGS[name], 0, plan.rewrap_at, save=saver(name))
        if rank == 0:
            out.put(("way", name, "a", a))
            out.put(("way", name, "b", b))
    timed = time_configs(w, plan, names)
    if rank == 0:
        out.put(("time", timed))


def worker_c(rank: int, port: int, plan: Plan, name: str, state_dir: str, out: Any) -> None:
    """Way (c): a fresh process resumes ``name`` from the saved state in a new group."""
    import torch

    w = Worker(rank, port, f"c/{name}")

    def load(model: Any, opt: Any) -> None:
        blob = torch.load(os.path.join(state_dir, f"{name}.pt"), weights_only=True)
        model.load_state_dict(blob["model"])
        opt.load_state_dict(blob["optim"])

    c = train(w, plan, CONFIGS[name], plan.resume_at, (), load=load)
    if rank == 0:
        out.put(("way", name, "c", c))


# --- the parent ----------------------------------------------------------------------


@contextmanager
def hosted_store() -> Iterator[int]:
    """A TCPStore on 127.0.0.1 that outlives every group, as tp run's; its port."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    store = dist.TCPStore(
        "127.0.0.1", port, WORLD, is_master=True, timeout=PG_TIMEOUT, wait_for_workers=False
    )
    try:
        yield port
    finally:
        del store


def spawn(target: Callable[..., None], *args: Any) -> list[Any]:
    """Run ``target(rank, *args, queue)`` in WORLD fresh processes; what they put on the queue.

    Forked from a fork server that has imported torch and nothing else (no group, no DDP, no
    thread pool yet), so a process is fresh without paying torch's import each time.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.nn.parallel"])
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, *args, out)) for rank in range(WORLD)]
    for p in procs:
        p.start()
    got, deadline = [], time.monotonic() + WORKER_TIMEOUT_S
    try:
        while any(p.is_alive() for p in procs) or not out.empty():
            try:
                got.append(out.get(timeout=0.2))
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"workers still running after {WORKER_TIMEOUT_S:.0f} s") from None
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"a worker exited with {failed[0]}; its traceback is above")
    return got


def run(plan: Plan, names: list[str]) -> list[Row]:
    """Every configuration in ``names`` in the three ways, and timed; the rows."""
    rows = {name: Row(name, CONFIGS[name]) for name in names}
    # DDP's C++ warning that find_unused_parameters=True found no unused parameter, once per
    # rank and wrap: true, and the point of this script, but it buries the table.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    state_dir = tempfile.mkdtemp(prefix="ddp_determinism.")
    try:
        with hosted_store() as port:
            results = spawn(worker_ab, port, plan, names, state_dir)
            for name in names:
                results += spawn(worker_c, port, plan, name, state_dir)
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)
    for item in results:
        if item[0] == "way":
            _, name, way, outcome = item
            rows[name].ways[way] = outcome
        else:
            for name, seconds in item[1].items():
                rows[name].step_s = seconds
    return [rows[name] for name in names]


def check_rewrap(kwargs: Mapping[str, Any], plan: Plan) -> tuple[Outcome, Outcome]:
    """Way (a) and way (b) for ``kwargs`` alone (the unit test's check): rank 0's outcomes."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    with hosted_store() as port:
        got = {item[2]: item[3] for item in spawn(worker_rewrap, port, plan, dict(kwargs))}
    return got["a"], got["b"]


# --- the table -----------------------------------------------------------------------


def first_difference(ref: Outcome, other: Outcome, offset: int) -> str:
    """The first step (0-based, as trained) whose parameters differ from ``ref``'s; '-' if none."""
    for i, h in enumerate(other.step_sha256):
        if h != ref.step_sha256[offset + i]:
            return str(offset + i)
    return "-"


def verdict(ref: Outcome, other: Outcome, offset: int) -> str:
    if (other.params_sha256, other.optim_sha256) == (ref.params_sha256, ref.optim_sha256):
        return "equal"
    differing = int((ref.flat != other.flat).sum())
    return f"DIFF@{first_difference(ref, other, offset)} ({differing}/{ref.flat.size})"


def table(rows: list[Row], plan: Plan, default: Mapping[str, Any]) -> str:
    base = next((r.step_s for r in rows if r.name == "find_unused" and r.step_s), None)
    head = (
        f"{'config':<13} {'ddp kwargs':<34} {'(b) rewrap vs (a)':<24} {'(c) resume vs (a)':<24} "
        f"{'ms/step':>8} {'vs find_unused':>14}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        a, b, c = r.ways["a"], r.ways["b"], r.ways["c"]
        ms = f"{r.step_s * 1e3:8.2f}" if r.step_s else f"{'?':>8}"
        rel = f"{(r.step_s / base - 1) * 100:+13.1f}%" if base and r.step_s else f"{'':>14}"
        mark = " *" if dict(r.kwargs) == dict(default) else ""
        agree = "" if a.ranks_agree and b.ranks_agree and c.ranks_agree else "  (ranks disagree!)"
        lines.append(
            f"{r.name + mark:<13} {r.kwargs!s:<34} {verdict(a, b, 0):<24} "
            f"{verdict(a, c, plan.resume_at):<24} {ms} {rel}{agree}"
        )
    lines.append(
        "* = ElasticTrainer's default. equal = SHA-256 of the final params and AdamW state equal; "
        "DIFF@s (n/N) = the params first differ after step s, n of N elements differ at the end."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="steps of each run (default 30)")
    p.add_argument(
        "--configs", default=",".join(CONFIGS), help="comma-separated subset of: " + ", ".join(CONFIGS)
    )
    p.add_argument("--quick", action="store_true", help="8 steps, d_model 32: checks that it works")
    opts = p.parse_args(argv)
    import torch

    from torchpass_slurm.rank.elastic import DEFAULT_DDP_KWARGS

    steps = 8 if opts.quick else opts.steps
    size = ["--d-model", "32", "--n-layers", "1"] if opts.quick else ["--d-model", "128", "--n-layers", "2"]
    plan = Plan(
        steps=steps,
        rewrap_at=(steps // 3, 2 * steps // 3),
        timing_rounds=2 if opts.quick else 6,
        timing_steps=3 if opts.quick else 5,
        model_args=(*size, "--context", "32", "--batch-size", "8", "--lr", "1e-2", "--threads", "1"),
    )
    names = [n for n in opts.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"unknown config {unknown[0]!r}; valid: {', '.join(CONFIGS)}")
    skipped = [n for n in names if not supported(CONFIGS[n])]
    names = [n for n in names if n not in skipped]
    started = time.monotonic()
    rows = run(plan, names)
    print(
        f"torch {torch.__version__}, gloo, {WORLD} CPU processes on 127.0.0.1, 1 thread each; tiny_gpt "
        f"{' '.join(plan.model_args)}; AdamW; {plan.steps} steps; (b) re-wrapped before steps "
        f"{', '.join(map(str, plan.rewrap_at))}; (c) resumed at step {plan.resume_at}"
    )
    print(table(rows, plan, DEFAULT_DDP_KWARGS))
    if skipped:
        print(f"skipped (this torch's DDP lacks a keyword): {', '.join(skipped)}")
    print(
        f"ms/step: median of {plan.timing_rounds} x {plan.timing_steps} steady-state steps per config, "
        f"round robin, rank 0; whole run {time.monotonic() - started:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
