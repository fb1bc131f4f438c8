"""ElasticTrainer's DDP keyword arguments keep a re-wrapped run bitwise equal to one never re-wrapped.

Check (b) of ``benchmarks/experiments/ddp_determinism.py``, small: 3 gloo processes on
127.0.0.1 train sbatch-examples/tiny_gpt.py's model shrunk (d_model 32, one
layer) for 6 steps, once in one DDP wrap and once re-wrapped in a fresh DDP on
a fresh process group before steps 2 and 4, as after a live migration. The
final parameters and AdamW state must hash the same. Without
``find_unused_parameters=True`` they do not: DDP rebuilds its buckets after a
wrap's first step, so that step reduces on another bucket layout, and gloo
sums each element in an order set by its place in the bucket.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("numpy")

from benchmarks.experiments import ddp_determinism as bench
from torchpass_slurm.rank.elastic import DEFAULT_DDP_KWARGS, ElasticTrainer

PLAN = bench.Plan(
    steps=6,
    rewrap_at=(2, 4),
    timing_rounds=0,
    timing_steps=0,
    model_args=("--d-model", "32", "--n-layers", "1", "--context", "16", "--batch-size", "4", "--lr", "1e-2"),
)


def test_the_trainer_wraps_with_the_module_defaults_unless_told_otherwise() -> None:
    unused: Any = None  # the constructor only stores the runtime, model and optimizer
    trainer = ElasticTrainer(unused, unused, unused, state={})
    assert trainer.ddp_kwargs == dict(DEFAULT_DDP_KWARGS)
    mine = {"find_unused_parameters": False, "static_graph": True}
    assert ElasticTrainer(unused, unused, unused, state={}, ddp_kwargs=mine).ddp_kwargs == mine


def test_a_rewrapped_run_ends_bitwise_equal_to_one_wrap() -> None:
    one_wrap, rewrapped = bench.check_rewrap(DEFAULT_DDP_KWARGS, PLAN)
    assert one_wrap.ranks_agree and rewrapped.ranks_agree
    assert rewrapped.step_sha256 == one_wrap.step_sha256
    assert rewrapped.params_sha256 == one_wrap.params_sha256
    assert rewrapped.optim_sha256 == one_wrap.optim_sha256
