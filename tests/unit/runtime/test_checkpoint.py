"""Checkpoints on torch.distributed.checkpoint, in one process (no process group)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torchpass_slurm.errors import CheckpointError  # noqa: E402
from torchpass_slurm.rank import checkpoint  # noqa: E402


def make(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    """Steps whose data and dropout come from the global RNGs (so RNG restore matters)."""
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 8) + random.random()
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, object]:
    return {"train": checkpoint.TrainState(model, opt), "rng": checkpoint.RNGState()}


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_round_trip_continues_bitwise_identically(tmp_path: Path) -> None:
    model, opt = make()
    train(model, opt, 3)
    checkpoint.save(state_of(model, opt), tmp_path, step=3)
    expected = train(model, opt, 4)
    expected_params = params(model)

    other, other_opt = make(seed=99)  # different weights, fresh optimizer, other RNG position
    random.random()
    assert checkpoint.load_latest(state_of(other, other_opt), tmp_path) == 3
    assert train(other, other_opt, 4) == expected
    assert all(torch.equal(a, b) for a, b in zip(params(other), expected_params, strict=True))


def test_keeps_the_last_k_and_points_latest_at_the_newest(tmp_path: Path) -> None:
    model, opt = make()
    for step in (10, 20, 30, 40):
        checkpoint.save(state_of(model, opt), tmp_path, step=step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000030", "step-00000040"]
    assert (tmp_path / "latest").read_text() == "step-00000040\n"
    assert checkpoint.latest_step(tmp_path) == 40


def test_torn_checkpoint_is_ignored(tmp_path: Path) -> None:
    model, opt = make()
    checkpoint.save(state_of(model, opt), tmp_path, step=5)
    torn = tmp_path / ".tmp-step-00000006"  # a save that crashed before the rename
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"partial")
    half = tmp_path / "step-00000007"  # a step folder without DCP's .metadata
    half.mkdir()
    assert checkpoint.latest_step(tmp_path) == 5
    assert checkpoint.load_latest(state_of(*make()), tmp_path) == 5
    checkpoint.save(state_of(model, opt), tmp_path, step=6)  # the torn folder is replaced
    assert checkpoint.latest_step(tmp_path) == 6


def test_stale_latest_pointer_falls_back_to_newest_complete(tmp_path: Path) -> None:
    model, opt = make()
    checkpoint.save(state_of(model, opt), tmp_path, step=1)
    (tmp_path / "latest").write_text("step-00000099\n")
    assert checkpoint.latest_step(tmp_path) == 1


def test_no_checkpoint_returns_none_and_leaves_state_alone(tmp_path: Path) -> None:
    model, opt = make()
    before = params(model)
    assert checkpoint.load_latest(state_of(model, opt), tmp_path / "missing") is None
    assert all(torch.equal(a, b) for a, b in zip(params(model), before, strict=True))


def test_mismatched_state_is_a_checkpoint_error(tmp_path: Path) -> None:
    model, opt = make()
    checkpoint.save(state_of(model, opt), tmp_path, step=2)
    bigger = torch.nn.Linear(8, 32)
    state = {"train": checkpoint.TrainState(bigger, torch.optim.AdamW(bigger.parameters()))}
    with pytest.raises(CheckpointError, match=r"loading the checkpoint .*step-00000002 failed"):
        checkpoint.load_latest(state, tmp_path)


def test_keep_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="keep=0"):
        checkpoint.save({}, tmp_path, step=1, keep=0)
