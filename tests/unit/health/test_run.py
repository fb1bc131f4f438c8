"""One health run: the time bound, the ECC state file across runs, host facts."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from torchpass_slurm.health.checks import Status
from torchpass_slurm.health.config import HealthConfig
from torchpass_slurm.health.facts import GpuFacts, HostFacts
from torchpass_slurm.health.host import gather_host, parse_meminfo
from torchpass_slurm.health.run import run_health
from torchpass_slurm.health.sources.simulated import SimulatedSource

from .conftest import NOW, Sim, gpu, host, sim_gpu


class SleepingSource:
    """A device library stuck in the driver."""

    name = "nvml"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.release = threading.Event()

    def gpus(self) -> tuple[GpuFacts, ...]:
        self.release.wait(self.seconds)
        return (gpu(),)


def test_a_hung_source_is_unknown_within_the_timeout(tmp_path: Path) -> None:
    source = SleepingSource(30)
    started = time.monotonic()
    report = run_health(
        HealthConfig(timeout_s=0.3, expected_gpus=1, state_file=""), source, node="n1", host=host
    )
    elapsed = time.monotonic() - started
    source.release.set()
    assert elapsed < 2.0
    assert report.status == Status.UNKNOWN
    [count] = [r for r in report.results if r.check == "gpu_count"]
    assert count.message == "no GPU facts: the device source did not answer within 0.3 s (timeout_s)"


def test_a_hung_host_gather_is_unknown(tmp_path: Path) -> None:
    stuck = threading.Event()

    def hanging_host() -> HostFacts:
        stuck.wait(30)
        return host()

    cfg = HealthConfig(timeout_s=0.2, state_file="", disk_paths=("/nfs/home",))
    report = run_health(cfg, SimulatedSource(_write(tmp_path, {"gpus": []})), node="n1", host=hanging_host)
    stuck.set()
    disk = [r for r in report.results if r.check == "host_disk"]
    assert [(r.status, r.message) for r in disk] == [
        (
            Status.UNKNOWN,
            "/nfs/home: free space unknown: did not finish within 0.2 s (timeout_s; a hung file system?)",
        )
    ]


def _write(tmp_path: Path, doc: dict) -> Path:  # type: ignore[type-arg]
    path = tmp_path / "devices.json"
    path.write_text(json.dumps(doc))
    return path


def test_ecc_rate_across_runs_with_the_state_file(sim: Sim) -> None:
    cfg = HealthConfig(state_file=str(sim.state), expected_gpus=1)
    times = iter([NOW, NOW + 1800, NOW + 3600, NOW + 7300])

    def run(corrected: int) -> Status:
        sim.gpus(sim_gpu(0, ecc_corrected=corrected))
        report = run_health(
            cfg, SimulatedSource(sim.devices), node="n1", host=host, wall_clock=lambda: next(times)
        )
        [rate] = [r for r in report.results if r.check == "gpu_ecc_corrected_rate"]
        return rate.status

    assert run(10) == Status.OK  # first sample stored
    assert json.loads(sim.state.read_text())["ecc"] == {"GPU-0": {"ecc_corrected": 10, "time": NOW}}
    assert (
        run(70) == Status.WARNING
    )  # 60 in half an hour: 120/h; the sample is kept (younger than the window)
    assert run(1100) == Status.CRITICAL  # 1090 in an hour; the window passed: the sample is replaced
    assert json.loads(sim.state.read_text())["ecc"]["GPU-0"] == {"ecc_corrected": 1100, "time": NOW + 3600}
    assert run(1150) == Status.OK  # 50 in 3700 s


def test_an_unwritable_state_file_does_not_break_the_run(sim: Sim) -> None:
    blocker = sim.root / "file"
    blocker.write_text("")
    cfg = HealthConfig(state_file=str(blocker / "state.json"), expected_gpus=2)
    report = run_health(cfg, SimulatedSource(sim.devices), node="n1", host=host)
    assert report.status == Status.OK


def test_host_facts(tmp_path: Path) -> None:
    assert parse_meminfo("MemTotal:  2048 kB\nMemFree: 1 kB\nMemAvailable:  1024 kB\n") == (2.0, 1.0)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  2048 kB\nMemAvailable:  1024 kB\n")
    facts = gather_host([str(tmp_path), str(tmp_path / "missing")], meminfo)
    assert (facts.memory_total_mb, facts.memory_available_mb) == (2.0, 1.0)
    assert facts.disks[0].free_mb is not None and facts.disks[0].free_mb > 0
    assert facts.disks[1].error == "No such file or directory"
    assert (
        gather_host([], tmp_path / "nope").error
        == f"cannot read {tmp_path / 'nope'}: No such file or directory"
    )


def test_report_json() -> None:
    report = run_health(
        HealthConfig(state_file="", expected_gpus=0),
        SleepingSource(0),
        node="n7",
        host=host,
        wall_clock=lambda: NOW,
    )
    doc = report.as_dict()
    assert (doc["node"], doc["source"], doc["status"], doc["exit_code"], doc["time"]) == (
        "n7",
        "nvml",
        "OK",
        0,
        NOW,
    )
    assert doc["results"][0] == {
        "check": "gpu_count",
        "status": "OK",
        "gpu": None,
        "message": "1 GPU(s) working; count not checked (expected_gpus = 0)",
    }
