"""sbatch-examples/tiny_gpt.py for real: 2 processes, gloo on 127.0.0.1, real checkpoints.

The model is shrunk (d_model 64, 2 layers) so that the three runs fit in a few
seconds each on a 2-core machine; the code path is the example's own.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ..gloo_ranks import run_script_ranks

pytest.importorskip("torch")
pytest.importorskip("numpy")  # torch.distributed's object collectives (used by DCP) need it

SCRIPT = Path(__file__).resolve().parents[3] / "sbatch-examples" / "tiny_gpt.py"
SMALL = [
    "--d-model",
    "64",
    "--n-layers",
    "2",
    "--context",
    "32",
    "--batch-size",
    "8",
    "--steps",
    "20",
    "--ckpt-every",
    "5",
    "--log-every",
    "2",
    "--threads",
    "1",
    "--lr",
    "1e-2",
]
DONE = re.compile(
    r"^done step=(\d+) loss=(\S+) params_sha256=([0-9a-f]{64}) optim_sha256=([0-9a-f]{64})$", re.M
)


def run_ranks(world: int, args: list[str], *, expect: int = 0) -> str:
    """Run the example as ``world`` ranks (torchrun-style env); rank 0's stdout."""
    return run_script_ranks([str(SCRIPT), *SMALL, *args], world, expect=expect)


def losses(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step=\d+ loss=(\S+)$", out, re.M)]


def test_loss_falls_and_a_resumed_run_ends_bitwise_equal(tmp_path: Path) -> None:
    full = run_ranks(2, ["--ckpt-dir", str(tmp_path / "a")])
    curve = losses(full)
    assert len(curve) == 10 and curve[-1] < curve[0] - 1.0, full
    done = DONE.search(full)
    assert done and done.group(1) == "20"

    # interrupted after step 12: the newest checkpoint is step 10; steps 11-12 are recomputed
    run_ranks(2, ["--ckpt-dir", str(tmp_path / "b"), "--fail-at-step", "12"], expect=17)
    assert (tmp_path / "b" / "latest").read_text() == "step-00000010\n"
    resumed = run_ranks(2, ["--ckpt-dir", str(tmp_path / "b")])
    again = DONE.search(resumed)
    assert again and again.group(3) == done.group(3), (full, resumed)
    assert again.group(4) == done.group(4), "optimizer state differs after the resume"
    assert again.group(2) == done.group(2)
