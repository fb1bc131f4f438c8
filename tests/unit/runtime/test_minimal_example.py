"""sbatch-examples/minimal.py for real: 2 processes, gloo on 127.0.0.1, no Slurm, no tp run.

The example imports only ``torchpass_slurm.train``; this runs it as torchrun would (RANK,
WORLD_SIZE, MASTER_ADDR in the environment), checks that its loss falls, and that a second
run resumes from the first one's checkpoint instead of starting again.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from ..gloo_ranks import run_script_ranks

pytest.importorskip("torch")
pytest.importorskip("numpy")  # torch.distributed's object collectives (used by DCP) need it

SCRIPT = Path(__file__).resolve().parents[3] / "sbatch-examples" / "minimal.py"


def run_ranks(world: int, extra_env: dict[str, str]) -> str:
    """Run the example as ``world`` ranks (torchrun-style env); rank 0's stdout."""
    return run_script_ranks([str(SCRIPT)], world, env={"OMP_NUM_THREADS": "1", **extra_env})


def logged(out: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"^step=(\d+) loss=(\S+)$", out, re.M)}


def test_the_example_imports_only_the_public_module() -> None:
    tree = ast.parse(SCRIPT.read_text())
    ours = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)} | {
        alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    assert {m for m in ours if m and m.startswith("torchpass_slurm")} == {"torchpass_slurm.train"}


def test_two_ranks_train_and_a_second_run_resumes_from_the_checkpoint(tmp_path: Path) -> None:
    env = {"TORCHPASS_RUN_DIR": str(tmp_path), "STEPS": "40", "CKPT_EVERY": "20"}
    first = logged(run_ranks(2, env))
    assert sorted(first) == [10, 20, 30, 40]
    assert first[40] < first[10]
    assert (tmp_path / "checkpoints").is_dir()

    resumed = logged(run_ranks(2, {**env, "STEPS": "50"}))
    assert sorted(resumed) == [50]  # steps 1-40 came from the checkpoint of step 40
