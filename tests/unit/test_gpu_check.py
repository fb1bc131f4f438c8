"""scripts/gpu-check on a machine without a GPU, and how it guards and judges its steps.

The GPU steps themselves (NCCL abort and shrink, the spare, the shard transfer, NVML)
need a GPU and did not run here: docs/gpu.md lists them as untested.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from scripts import gpu_check
from scripts.gpu_check import FAILED, OK, SKIPPED, StepResult

REPO = Path(__file__).resolve().parents[2]


def test_without_a_gpu_it_says_so_and_exits_0(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    out = tmp_path / "report.json"
    done = subprocess.run(
        [str(REPO / "scripts" / "gpu-check"), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,  # the script finds its repository from its own path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == (
        "gpu-check: no GPU on this machine (torch.cuda.is_available() is False): nothing to check\n"
    )
    report = json.loads(out.read_text())
    assert report["gpu"] is False
    assert [(s["name"], s["status"]) for s in report["steps"]] == [("environment", "skipped")]


def test_only_a_failed_step_that_ran_makes_the_exit_status_non_zero() -> None:
    assert gpu_check.exit_code([StepResult("a", OK), StepResult("b", SKIPPED, "no pynvml")]) == 0
    assert gpu_check.exit_code([StepResult("a", OK), StepResult("b", FAILED, "not equal")]) == 1
    assert gpu_check.exit_code([]) == 0


def test_a_step_that_raises_is_that_steps_failure() -> None:
    def broken() -> StepResult:
        raise RuntimeError("NCCL error: unhandled system error")

    result = gpu_check.run_step("nccl-abort", broken)
    assert (result.name, result.status) == ("nccl-abort", FAILED)
    assert result.detail == "RuntimeError: NCCL error: unhandled system error"


@pytest.mark.parametrize(
    ("nccl", "gpus", "problem"),
    [
        ((2, 30, 7), 1, None),
        ((2, 29, 3), 2, None),  # two GPUs: one rank each, any NCCL
        ((2, 27, 5), 1, "one GPU and NCCL 2.27.5: two ranks on one GPU need NCCL >= 2.30.0"),
        (None, 1, "torch reports no NCCL version"),
    ],
)
def test_two_ranks_need_two_gpus_or_nccl_2_30(nccl: Any, gpus: int, problem: str | None) -> None:
    got = gpu_check.multi_rank_problem(nccl, gpus)
    if problem is None:
        assert got is None
    else:
        assert got is not None and got.startswith(problem)


def test_steps_that_cannot_run_say_why_and_the_rest_go_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    facts = {"torch": "x", "cuda": True, "gpus": 1, "names": ["GPU"], "nccl": [2, 26, 2], "pynvml": False}
    monkeypatch.setattr(gpu_check, "environment", lambda: (StepResult("environment", OK, "1 GPU"), facts))

    def transfer(shard_mb: int, gpus: int) -> StepResult:
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(gpu_check, "transfer_step", transfer)
    monkeypatch.setattr(
        gpu_check, "nvml_step", lambda: StepResult("nvml", SKIPPED, "pynvml is not installed")
    )
    out = tmp_path / "r.json"

    assert gpu_check.main(["--json", str(out)]) == 1
    steps = {s["name"]: s for s in json.loads(out.read_text())["steps"]}
    assert [steps[n]["status"] for n in ("nccl-abort", "nccl-shrink", "transfer", "nvml")] == [
        SKIPPED,
        SKIPPED,
        FAILED,
        SKIPPED,
    ]
    assert "NCCL >= 2.30.0" in steps["nccl-abort"]["detail"]
    assert steps["transfer"]["detail"] == "RuntimeError: CUDA out of memory"
    printed = capsys.readouterr().out
    assert "[ FAILED] transfer: RuntimeError: CUDA out of memory" in printed
    assert printed.rstrip().endswith("gpu-check: a step failed")


def test_shrink_needs_nccl_2_27_and_skipping_it_passes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    facts = {"torch": "x", "cuda": True, "gpus": 2, "names": ["A", "B"], "nccl": [2, 21, 5], "pynvml": False}
    monkeypatch.setattr(gpu_check, "environment", lambda: (StepResult("environment", OK, "2 GPUs"), facts))
    trials: list[str] = []

    def trial(mode: str, gpus: int, env: dict[str, str]) -> StepResult:
        trials.append(mode)
        assert env["NCCL_MULTI_RANK_GPU_ENABLE"] == "1" and "NCCL_P2P_DISABLE" not in env
        return StepResult(f"nccl-{mode}", OK, "recovered", {"abort_s": 0.2})

    monkeypatch.setattr(gpu_check, "nccl_trial", trial)
    out = tmp_path / "r.json"
    assert gpu_check.main(["--only", "nccl", "--json", str(out)]) == 0
    assert trials == ["abort"]
    steps = {s["name"]: s for s in json.loads(out.read_text())["steps"]}
    assert steps["nccl-shrink"] == {
        "name": "nccl-shrink",
        "status": SKIPPED,
        "detail": "NCCL 2.21.5 < 2.27.3",
        "numbers": {},
    }


def test_the_abort_trial_runs_through_the_seam_on_gloo() -> None:
    """The trial's processes, kill, abort and spare, on the CPU with the seam's GlooBackend:
    the harness that runs NCCL on a GPU machine (where nothing of it has run yet)."""
    pytest.importorskip("torch")
    result = gpu_check.nccl_trial("abort", 1, {}, kind="gloo")
    assert (result.status, result.detail) == (OK, "rank 1 SIGKILLed mid-all-reduce; rank 0 recovered")
    assert result.numbers["aborted"] == 1.0 and result.numbers["fresh"] == 1.0
    assert result.numbers["warm/0"] == result.numbers["warm/1"] == 8.0  # 1, 2, 4, 8: both ranks reduced
    assert 0 < result.numbers["spare_s"] < gpu_check.TRIAL_TIMEOUT_S


def test_the_transfer_step_moves_a_shard_bitwise_on_host_memory() -> None:
    pytest.importorskip("torch")
    result = gpu_check.transfer_step(4, 1, kind="cpu")
    assert (result.status, result.numbers["bitwise_equal"]) == (OK, True)
    assert result.numbers["tensors"] == 400
    assert result.numbers["chunks"] == -(-result.numbers["bytes"] // (4 << 20))


def test_a_trial_whose_rank_fails_is_a_failed_step() -> None:
    """gloo cannot shrink: the seam rebuilds fresh where the shrink trial wants a shrink, rank 0
    raises, and the step fails at once with what happened (not after the trial's limit)."""
    pytest.importorskip("torch")
    result = gpu_check.nccl_trial("shrink", 1, {}, kind="gloo")
    assert result.status == FAILED
    assert result.detail.startswith(
        "missing ['shrink_s', 'shrunk', 'shrunk_allreduce']: rank 0 exited with status 1"
    )
