"""Shard checkpoints between real gloo ranks: every rank writes and reads its own shards, and
a run restarted from one ends bitwise equal to a run never interrupted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchpass_slurm.rank import shard_checkpoint

from ..elastic.test_sync_state import assert_same
from . import ranks

EVERY, STEPS = 2, 5


def test_a_run_resumed_from_its_shard_checkpoint_ends_bitwise_equal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("USE_LIBUV", "0")
    with ranks.host_store(tmp_path) as port:
        ranks.run([("ckpt", r) for r in range(2)], "1x2", port, tmp_path, EVERY, STEPS)
    ckpt = tmp_path / "ckpt"
    assert shard_checkpoint.latest_step(ckpt) == 4
    folder = ckpt / "step-00000004"
    files = sorted(p.name for p in folder.iterdir())
    assert files == ["shards-00000.tpst", "shards-00001.tpst", "shards.json"]
    assert json.loads((folder / "shards.json").read_text())["step"] == 4
    with open(folder / "shards-00001.tpst", "rb") as f:
        assert f.read(4) == b"TPST"  # the transfer stream's format: no pickle

    with ranks.host_store(tmp_path) as port:
        ranks.run([("resume", r) for r in range(2)], "1x2", port, tmp_path, EVERY, STEPS)
    for rank in range(2):
        full, resumed = ranks.load(tmp_path, "ckpt", rank), ranks.load(tmp_path, "resume", rank)
        assert resumed["step"] == STEPS
        assert_same(resumed["state"], full["state"], f"rank{rank}")
    (resumed_report,) = [f for e, f in ranks.load(tmp_path, "resume", 0)["reports"] if e == "resumed"]
    assert resumed_report["step"] == 4
