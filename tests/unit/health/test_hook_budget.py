"""The hooks finish in time whatever the device library does (issue 11, item 6).

A fake ``pynvml`` on ``sys.path`` hangs in C holding the GIL, stalls in Python,
hangs at import, raises SystemExit at import, exits the process or crashes it;
a fake ``scontrol`` on ``PATH`` hangs. Each hook (prolog, epilog, node-check)
must end by its budget with UNKNOWN for the GPU checks and drain nothing unless
``drain_on_unknown`` is set. The facts are gathered in a child process that is
killed at ``timeout_s`` (torchpass_slurm/health/child.py): these cases use a
small ``timeout_s``; one test runs a real ``tp`` process at the default budget.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import FakeSlurm, Sim, sim_gpu, tp

#: A small gathering budget, so each hung case costs a fraction of a second.
BUDGET_S = 0.3
#: What the whole hook may take beyond the budget here (fork, judging, the CLI; a loaded host).
SLACK_S = 1.5

_FAKE_HEADER = """\
import ctypes, os, signal, sys, time

class NVMLError(Exception):
    pass

NVML_ERROR_GPU_IS_LOST = 15
"""

#: name -> (code run at import, code run in nvmlInit)
BEHAVIOURS = {
    "hangs_in_c_holding_the_gil": ("", "ctypes.PyDLL(None).sleep(60)"),
    "stalls_in_python": ("", "while True:\n        pass"),
    "hangs_at_import": ("time.sleep(60)", "pass"),
    "exits_at_import": ("raise SystemExit(2)", "pass"),
    "exits_the_process": ("", "os._exit(2)"),
    "crashes": ("", "ctypes.string_at(0)"),
}
HUNG = "the device source did not answer within 0.3 s (timeout_s)"
EXPECTED = {
    "hangs_in_c_holding_the_gil": HUNG,
    "stalls_in_python": HUNG,
    "hangs_at_import": HUNG,
    "exits_at_import": "pynvml does not import: SystemExit: 2",
    "exits_the_process": "the device source failed: the device source ended without an answer "
    "(exit status 2)",
    "crashes": "the device source failed: the device source ended without an answer "
    "(killed by signal 11 (SIGSEGV))",
}


def fake_pynvml(folder: Path, behaviour: str) -> Path:
    at_import, in_init = BEHAVIOURS[behaviour]
    folder.mkdir(exist_ok=True)
    (folder / "pynvml.py").write_text(
        f"{_FAKE_HEADER}\n{at_import}\n\ndef nvmlInit():\n    {in_init}\n\ndef nvmlShutdown():\n    pass\n"
    )
    return folder


@pytest.fixture
def library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    """Install a misbehaving pynvml for this test (imported only in the gathering child)."""
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)

    def install(behaviour: str) -> None:
        monkeypatch.syspath_prepend(str(fake_pynvml(tmp_path / "lib", behaviour)))

    return install


def unknown_line(message: str) -> str:
    gpu_checks = ("gpu_count", "gpu_ecc_uncorrected", "gpu_ecc_corrected_rate")
    found = "; ".join(f"UNKNOWN {check}: no GPU facts: {message}" for check in gpu_checks)
    return f"torchpass: n1 UNKNOWN: {found} (not drained)\n"


@pytest.mark.parametrize("behaviour", list(BEHAVIOURS))
@pytest.mark.parametrize(("hook", "code"), [("prolog", 0), ("epilog", 0), ("node-check", 3)])
def test_a_misbehaving_library_is_unknown_in_time_and_drains_nothing(
    sim: Sim, slurm: FakeSlurm, library: object, behaviour: str, hook: str, code: int
) -> None:
    library(behaviour)  # type: ignore[operator]
    sim.configure(timeout_s=BUDGET_S)
    started = time.monotonic()
    result = tp("health", hook, "--source", "nvml")
    took = time.monotonic() - started
    assert result == (code, "", unknown_line(EXPECTED[behaviour]))
    assert took < BUDGET_S + SLACK_S, f"{hook} took {took:.2f} s"
    assert slurm.calls == []


@pytest.mark.parametrize("behaviour", ["hangs_in_c_holding_the_gil", "crashes"])
def test_with_drain_on_unknown_the_prolog_drains_once(
    sim: Sim, slurm: FakeSlurm, library: object, behaviour: str
) -> None:
    library(behaviour)  # type: ignore[operator]
    sim.configure(timeout_s=BUDGET_S, drain_on_unknown=True)
    result = tp("health", "prolog", "--source", "nvml")
    reason = f"torchpass: check failed: gpu_count: no GPU facts: {EXPECTED[behaviour]} (+10 more)"
    reason = reason if len(reason) <= 120 else reason[:117] + "..."
    assert result == (1, "", f"drained n1: {reason}\n")
    assert slurm.changes() == [("drain", "n1", reason)]


def hung_slurm(folder: Path) -> str:
    """A PATH whose scontrol and sinfo never answer (exec: the hung process is the one killed)."""
    folder.mkdir(exist_ok=True)
    for name in ("scontrol", "sinfo"):
        script = folder / name
        script.write_text("#!/bin/sh\nexec sleep 60\n")
        script.chmod(0o755)
    return f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"


def test_a_hung_scontrol_on_critical_is_cut_short(
    sim: Sim, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", hung_slurm(tmp_path / "bin"))
    sim.gpus(sim_gpu(0, ecc_uncorrected=4), sim_gpu(1))
    sim.configure(slurm_timeout_s=0.5)
    started = time.monotonic()
    result = tp("health", "prolog")
    took = time.monotonic() - started
    reason = "torchpass: gpu_ecc_uncorrected: GPU 0: 4 uncorrected ECC error(s) (critical at 1)"
    argv = f"scontrol update NodeName=n1 State=DRAIN 'Reason={reason}'"
    assert result == (
        1,
        "",
        f"{reason}; draining failed (`{argv}` did not finish within 0.5 s), slurmd drains the node\n",
    )
    assert took < 0.5 + SLACK_S, f"the prolog took {took:.2f} s"


def test_node_check_with_a_hung_scontrol_is_unknown(
    sim: Sim, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", hung_slurm(tmp_path / "bin"))
    sim.gpus(sim_gpu(0, ecc_uncorrected=4), sim_gpu(1))
    sim.configure(slurm_timeout_s=0.5)
    result = tp("health", "node-check")
    assert result == (3, "", "torchpass: n1: Slurm failed: `sinfo --json` did not finish within 0.5 s\n")


def test_the_default_budget_keeps_the_worst_hook_under_10_s(sim: Sim, tmp_path: Path) -> None:
    """A real `tp` process: a library hung in C holding the GIL, drain_on_unknown, a hung scontrol."""
    lib = fake_pynvml(tmp_path / "lib", "hangs_in_c_holding_the_gil")
    config = json.loads(sim.config.read_text())
    del config["timeout_s"]  # the defaults: timeout_s and slurm_timeout_s
    config["drain_on_unknown"] = True
    sim.config.write_text(json.dumps(config))
    env = {
        **os.environ,
        "PYTHONPATH": f"{lib}{os.pathsep}{Path(__file__).resolve().parents[3]}",
        "PATH": hung_slurm(tmp_path / "bin"),
        "TORCHPASS_HEALTH_CONFIG": str(sim.config),
        "SLURMD_NODENAME": "n1",
    }
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "torchpass_slurm.cli.main", "health", "node-check", "--source", "nvml"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    took = time.monotonic() - started
    assert took < 10, f"node-check took {took:.2f} s"
    assert (proc.returncode, proc.stdout) == (3, "")
    assert proc.stderr == ("torchpass: n1: Slurm failed: `sinfo --json` did not finish within 1.5 s\n")
