"""The in-job health agent: it reports a node's first WARNING/CRITICAL, never UNKNOWN."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from torchpass_slurm.health.agent import HealthAgent


class FakeRuntime:
    node = "c2"
    local_rank = 0

    def __init__(self) -> None:
        self.reports: list[tuple[str, dict[str, Any]]] = []

    def report(self, event: str, **fields: Any) -> None:
        self.reports.append((event, fields))


GPU = {"index": 0, "uuid": "GPU-0", "temperature_c": 60, "slowdown_c": 88, "shutdown_c": 95,
       "ecc_corrected": 0, "ecc_uncorrected": 0}


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> HealthAgent:
    monkeypatch.setenv("TORCHPASS_HEALTH_SIMULATE", str(tmp_path / "{node}.json"))
    monkeypatch.setenv("TORCHPASS_HEALTH_CONFIG", str(tmp_path / "health.toml"))
    monkeypatch.setenv("TORCHPASS_RUN_DIR", str(tmp_path / "run"))
    (tmp_path / "health.toml").write_text(f'disk_paths = ["{tmp_path}"]\n')
    return HealthAgent(FakeRuntime(), "c2", interval=1.0)  # type: ignore[arg-type]


def simulate(tmp_path: Path, **gpu: Any) -> None:
    (tmp_path / "c2.json").write_text(json.dumps({"gpus": [{**GPU, **gpu}]}))


def test_a_healthy_node_is_not_reported(agent: HealthAgent, tmp_path: Path) -> None:
    simulate(tmp_path)
    agent.judge(agent.check())
    assert agent.rt.reports == [] and not agent.reported


def test_heat_is_reported_once_with_what_was_seen(agent: HealthAgent, tmp_path: Path) -> None:
    simulate(tmp_path, temperature_c=86)
    agent.judge(agent.check())
    [(event, fields)] = agent.rt.reports
    assert event == "health_warning" and fields["node"] == "c2" and fields["status"] == "WARNING"
    assert "86" in fields["summary"], fields
    assert agent.reported


def test_a_broken_gpu_library_is_not_reported(agent: HealthAgent, tmp_path: Path) -> None:
    (tmp_path / "c2.json").write_text(json.dumps({"broken": "NVML_ERROR_LIB_RM_VERSION_MISMATCH"}))
    report = agent.check()
    assert report.status.name == "UNKNOWN"
    agent.judge(report)
    assert agent.rt.reports == []


def test_the_ecc_samples_go_to_the_run_folder(agent: HealthAgent, tmp_path: Path) -> None:
    simulate(tmp_path)
    agent.check()
    assert (tmp_path / "run" / ".torchpass" / "health-c2.json").exists()
