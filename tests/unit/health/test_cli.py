"""`tp health ...` end to end through the `tp` group: full output and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import FakeSlurm, Sim, sim_gpu, tp
from .test_sources import fake_pynvml


def test_check_ok_table(sim: Sim) -> None:
    sim.gpus(sim_gpu(0))
    sim.configure(expected_gpus=1, disk_paths=[])
    result = tp("health", "check")
    assert result.code == 0, result
    lines = [line.rstrip() for line in result.out.splitlines()]
    assert lines[0].split() == ["STATUS", "CHECK", "GPU", "MESSAGE"]
    assert [line.split()[:2] for line in lines[2:-1]] == [
        ["OK", "gpu_count"],
        ["OK", "gpu_ecc_uncorrected"],
        ["OK", "gpu_ecc_corrected_rate"],
        ["OK", "gpu_retired_pages"],
        ["OK", "gpu_xid"],
        ["OK", "gpu_temperature"],
        ["OK", "gpu_throttle"],
        ["OK", "gpu_pcie_link"],
        ["OK", "gpu_nvlink_errors"],
        ["OK", "host_memory"],
    ]
    assert "GPU 0: 60 C (warning at 83 C, critical at 88 C; slowdown 88 C)" in result.out
    assert lines[-1].startswith("n1: OK (source simulated, ")
    assert result.err == ""


@pytest.mark.parametrize(
    ("gpu", "code", "status"),
    [
        (sim_gpu(1, temperature_c=85), 1, "WARNING"),
        (sim_gpu(1, ecc_uncorrected=2), 2, "CRITICAL"),
        ({"index": 1, "lost": True}, 2, "CRITICAL"),
    ],
)
def test_check_exit_codes(sim: Sim, gpu: dict, code: int, status: str) -> None:  # type: ignore[type-arg]
    sim.gpus(sim_gpu(0), gpu)
    result = tp("health", "check", "--json")
    doc = json.loads(result.out)
    assert (result.code, doc["status"], doc["exit_code"], doc["node"]) == (code, status, code, "n1")


def test_check_broken_library_is_unknown(sim: Sim) -> None:
    sim.write({"broken": "NVML_ERROR_LIB_RM_VERSION_MISMATCH"})
    result = tp("health", "check", "--json")
    doc = json.loads(result.out)
    assert (result.code, doc["status"]) == (3, "UNKNOWN")
    assert doc["results"][0]["message"] == (
        "no GPU facts: the simulated library is broken: NVML_ERROR_LIB_RM_VERSION_MISMATCH"
    )


def test_check_hung_source_is_unknown_within_the_timeout(sim: Sim) -> None:
    sim.write({"hang_s": 20, "gpus": []})
    sim.configure(timeout_s=0.5)
    started = time.monotonic()
    result = tp("health", "check", "--json")
    assert time.monotonic() - started < 3
    assert (result.code, json.loads(result.out)["status"]) == (3, "UNKNOWN")


def test_check_with_a_bad_config_is_unknown(sim: Sim) -> None:
    sim.config.write_text('{"expected_gpu": 4}')
    result = tp("health", "check")
    assert result.code == 3
    assert result.err.startswith(f"error: unknown key(s) in {sim.config}: expected_gpu\n  hint: valid keys: ")
    json_result = tp("health", "check", "--json")
    assert json.loads(json_result.out)["status"] == "UNKNOWN" and json_result.code == 3


def test_nvml_raising_nvmlerror_is_unknown_and_never_drains(
    sim: Sim, slurm: FakeSlurm, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error=18))
    result = tp("health", "check", "--source", "nvml", "--json")
    doc = json.loads(result.out)
    assert (result.code, doc["status"], doc["source"]) == (3, "UNKNOWN", "nvml")
    assert doc["results"][0]["message"] == "no GPU facts: NVML did not initialise: NVMLError: NVML error 18"
    prolog = tp("health", "prolog", "--source", "nvml")
    assert prolog.code == 0
    assert prolog.err.startswith(
        "torchpass: n1 UNKNOWN: UNKNOWN gpu_count: no GPU facts: NVML did not initialise"
    )
    assert prolog.err.rstrip().endswith("(not drained)")
    assert slurm.calls == []


def test_a_source_that_exits_never_ends_the_prolog(
    sim: Sim, slurm: FakeSlurm, monkeypatch: pytest.MonkeyPatch
) -> None:
    def exits(self: object) -> None:
        raise SystemExit(2)  # a device library that calls sys.exit() must not make the prolog exit 2

    monkeypatch.setattr("torchpass_slurm.health.sources.simulated.SimulatedSource.gpus", exits)
    result = tp("health", "prolog")
    failed = "no GPU facts: the device source failed: SystemExit: 2"
    assert result == (
        0,
        "",
        f"torchpass: n1 UNKNOWN: UNKNOWN gpu_count: {failed}; UNKNOWN gpu_ecc_uncorrected: "
        f"{failed}; UNKNOWN gpu_ecc_corrected_rate: {failed} (not drained)\n",
    )
    assert slurm.calls == []


@pytest.mark.parametrize(("hook", "code"), [("prolog", 0), ("epilog", 0), ("node-check", 3)])
def test_a_bug_in_a_hook_leaves_the_node_alone(
    sim: Sim, slurm: FakeSlurm, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, hook: str, code: int
) -> None:
    from torchpass_slurm.cli import health as health_cli

    def broken(*args: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(health_cli, "_evaluate", broken)
    result = tp("health", hook)
    [log] = (tmp_path / "cache" / "torchpass-slurm").iterdir()
    assert result == (
        code,
        "",
        f"torchpass: health check broke: RuntimeError: boom; traceback in {log} (node not drained)\n",
    )
    assert f"command: tp health {hook}\n" in log.read_text()
    assert slurm.calls == []


def test_prolog_ok_is_quiet(sim: Sim, slurm: FakeSlurm) -> None:
    assert tp("health", "prolog") == (0, "", "")
    assert tp("health", "epilog") == (0, "", "")
    assert slurm.calls == []


def test_prolog_critical_drains_once_and_fails(sim: Sim, slurm: FakeSlurm) -> None:
    sim.gpus(sim_gpu(0), {"index": 1, "lost": True})
    result = tp("health", "prolog")
    assert result == (1, "", "drained n1: torchpass: gpu_count: GPU 1 is lost (fell off the bus) (+1 more)\n")
    assert slurm.calls == [
        ("drain", "n1", "torchpass: gpu_count: GPU 1 is lost (fell off the bus) (+1 more)")
    ]


def test_prolog_broken_drains_only_with_drain_on_unknown(sim: Sim, slurm: FakeSlurm) -> None:
    sim.write({"broken": "NVML_ERROR_LIB_RM_VERSION_MISMATCH"})
    assert tp("health", "prolog").code == 0
    assert slurm.calls == []
    sim.configure(drain_on_unknown=True)
    assert tp("health", "epilog").code == 1
    [(call, node, reason)] = slurm.calls
    assert (call, node) == ("drain", "n1")
    assert reason.startswith(
        "torchpass: check failed: gpu_count: no GPU facts: the simulated library is broken"
    )


def test_prolog_with_a_bad_config_passes_and_says_why(sim: Sim, slurm: FakeSlurm) -> None:
    sim.config.write_text('{"timeout_s": "soon"}')
    result = tp("health", "prolog")
    assert result == (
        0,
        "",
        f"torchpass: health check not run: {sim.config}: health setting timeout_s must be "
        "float, got 'soon' (node not drained)\n",
    )
    assert slurm.calls == []


def test_node_check_drains_and_auto_resumes(sim: Sim, slurm: FakeSlurm) -> None:
    from torchpass_slurm.slurm import Node

    sim.configure(auto_resume=True)
    sim.gpus(sim_gpu(0), sim_gpu(1, ecc_uncorrected=1))
    result = tp("health", "node-check")
    reason = "torchpass: gpu_ecc_uncorrected: GPU 1: 1 uncorrected ECC error(s) (critical at 1)"
    assert result == (2, "", f"drained n1: {reason}\n")
    slurm.known = [Node("n1", "IDLE", frozenset({"DRAIN"}), reason)]
    sim.gpus(sim_gpu(0), sim_gpu(1))
    assert tp("health", "node-check").code == 0
    assert slurm.changes() == [("drain", "n1", reason), ("resume", "n1")]


def test_undrain(slurm: FakeSlurm) -> None:
    from torchpass_slurm.slurm import Node

    slurm.known = [
        Node("n1", "IDLE", frozenset({"DRAIN"}), "torchpass: gpu_count: GPU 1 is lost"),
        Node("n2", "IDLE", frozenset({"DRAIN"}), "Prolog error"),
        Node("n3", "IDLE"),
    ]
    dry = tp("health", "undrain", "--dry-run")
    assert dry == (
        0,
        "would resume n1 (reason was: torchpass: gpu_count: GPU 1 is lost)\n"
        "skipped n2: drained for another reason (not torchpass): Prolog error\n",
        "",
    )
    assert slurm.changes() == []
    done = tp("health", "undrain", "n[1-3]")
    assert done.out == (
        "resumed n1 (reason was: torchpass: gpu_count: GPU 1 is lost)\n"
        "skipped n2: drained for another reason (not torchpass): Prolog error\n"
        "skipped n3: not drained (IDLE)\n"
    )
    assert slurm.changes() == [("resume", "n1")]


def test_install_shows_and_writes(tmp_path: Path) -> None:
    shown = tp("health", "install", "--tp", "/opt/tp/bin/tp", "--interval", "120")
    assert shown.code == 0
    assert (
        "==> slurm.conf.torchpass  (install as slurm.conf (append))\n"
        "# torchpass health checks (tp health install)\n"
        "Prolog=/etc/slurm/torchpass-prolog.sh\n"
        "Epilog=/etc/slurm/torchpass-epilog.sh\n"
        "# no PrologFlags=Alloc: tp run starts a step on every node (spares too) at once, and a\n"
        "# node merged into a running job (a spare refill) never gets the allocation prolog\n"
        "# and add permit_job_expansion to your SchedulerParameters (spare pool refills)\n"
        "HealthCheckProgram=/etc/slurm/torchpass-healthcheck.sh\n"
        "HealthCheckInterval=120\n"
        "HealthCheckNodeState=ANY,CYCLE\n"
    ) in shown.out
    assert "timeout -k 5 60 /opt/tp/bin/tp -q health prolog\n" in shown.out
    assert "==> health.toml  (install as /etc/torchpass/health.toml)\n" in shown.out
    written = tp("health", "install", "--write", str(tmp_path / "out"), "--tp", "/opt/tp/bin/tp")
    assert written.code == 0
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == [
        "health.toml",
        "slurm.conf.torchpass",
        "torchpass-epilog.sh",
        "torchpass-healthcheck.sh",
        "torchpass-prolog.sh",
    ]
    assert (tmp_path / "out" / "torchpass-prolog.sh").stat().st_mode & 0o777 == 0o755
    from torchpass_slurm.health.config import HealthConfig, load_config

    assert load_config(tmp_path / "out" / "health.toml") == HealthConfig()  # the template is the defaults
    again = tp("health", "install", "--write", str(tmp_path / "out"))
    assert again.code == 2 and "already holds" in again.err


def test_wrapper_script_runs(tmp_path: Path) -> None:
    """The rendered prolog wrapper is valid sh and passes tp's exit status through."""
    fake_tp = tmp_path / "tp"
    fake_tp.write_text("#!/bin/sh\nexit 1\n")
    fake_tp.chmod(0o755)
    assert tp("health", "install", "--write", str(tmp_path / "w"), "--tp", str(fake_tp)).code == 0
    proc = subprocess.run(
        ["sh", str(tmp_path / "w" / "torchpass-prolog.sh")], capture_output=True, timeout=30
    )
    assert proc.returncode == 1


def test_help_stays_light() -> None:
    code = (
        "import sys; from torchpass_slurm.cli.main import main; sys.argv=['tp','--help']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "bad=[m for m in ('rich','torchpass_slurm.health','torchpass_slurm.cli.health','pynvml')"
        " if m in sys.modules]\n"
        "assert not bad, bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "health" in proc.stdout
