"""The in-job health agent: it reports a node's first WARNING/CRITICAL, never UNKNOWN; close() stops it."""

from __future__ import annotations

import datetime
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from torchpass_slurm.health.run import HealthReport
from torchpass_slurm.rank.health_agent import CLOSE_TIMEOUT_S, HealthAgent


class Recorder:
    """A :class:`~torchpass_slurm.rank.health_agent.Report`: keeps what the agent reports."""

    def __init__(self) -> None:
        self.reports: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, event: str, **fields: Any) -> None:
        self.reports.append((event, fields))


GPU = {
    "index": 0,
    "uuid": "GPU-0",
    "temperature_c": 60,
    "slowdown_c": 88,
    "shutdown_c": 95,
    "ecc_corrected": 0,
    "ecc_uncorrected": 0,
}


@pytest.fixture
def health_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TORCHPASS_HEALTH_SIMULATE", str(tmp_path / "{node}.json"))
    monkeypatch.setenv("TORCHPASS_HEALTH_CONFIG", str(tmp_path / "health.toml"))
    monkeypatch.setenv("TORCHPASS_RUN_DIR", str(tmp_path / "run"))
    (tmp_path / "health.toml").write_text(f'disk_paths = ["{tmp_path}"]\n')
    return tmp_path


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def agent(health_env: Path, recorder: Recorder) -> HealthAgent:
    return HealthAgent(recorder, "c2", interval=1.0)


def simulate(tmp_path: Path, **gpu: Any) -> None:
    (tmp_path / "c2.json").write_text(json.dumps({"gpus": [{**GPU, **gpu}]}))


def wait_for(condition: Any, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_healthy_node_is_not_reported(agent: HealthAgent, recorder: Recorder, tmp_path: Path) -> None:
    simulate(tmp_path)
    agent.judge(agent.check())
    assert recorder.reports == [] and not agent.reported


def test_heat_is_reported_once_with_what_was_seen(
    agent: HealthAgent, recorder: Recorder, tmp_path: Path
) -> None:
    simulate(tmp_path, temperature_c=86)
    agent.judge(agent.check())
    [(event, fields)] = recorder.reports
    assert event == "health_warning" and fields["node"] == "c2" and fields["status"] == "WARNING"
    assert "86" in fields["summary"], fields
    assert agent.reported


def test_a_broken_gpu_library_is_not_reported(agent: HealthAgent, recorder: Recorder, tmp_path: Path) -> None:
    (tmp_path / "c2.json").write_text(json.dumps({"broken": "NVML_ERROR_LIB_RM_VERSION_MISMATCH"}))
    report = agent.check()
    assert report.status.name == "UNKNOWN"
    agent.judge(report)
    assert recorder.reports == []


def test_the_ecc_samples_go_to_the_run_folder(agent: HealthAgent, tmp_path: Path) -> None:
    simulate(tmp_path)
    agent.check()
    assert (tmp_path / "run" / ".torchpass" / "health-c2.json").exists()


# --- a spare's agent: it samples in standby, and reports once promoted -------------------


def test_a_spares_warning_is_held_until_its_promotion(
    health_env: Path, recorder: Recorder, tmp_path: Path
) -> None:
    spare = HealthAgent(None, "c2", interval=1.0)
    simulate(tmp_path, temperature_c=86)
    spare.judge(spare.check())
    assert spare.reported and recorder.reports == []  # in standby there is nobody to tell yet
    spare.deliver(recorder)
    ((event, fields),) = recorder.reports
    assert event == "health_warning" and fields["status"] == "WARNING" and fields["node"] == "c2"


def test_errors_that_rise_as_a_spare_is_promoted_are_a_rate_from_its_standby_samples(
    health_env: Path, recorder: Recorder, tmp_path: Path
) -> None:
    """The campaign's fault 49: 50,000 corrected errors appeared on a node 1 s after its promotion.
    An agent started at the promotion took them as its first sample (no rate, no warning)."""
    (tmp_path / "health.toml").write_text(f'disk_paths = ["{tmp_path}"]\necc_rate_min_interval_s = 1.0\n')
    simulate(tmp_path)
    spare = HealthAgent(None, "c2", interval=1.0)
    spare.judge(spare.check())  # in standby: no errors
    time.sleep(1.1)  # a rate needs samples at least ecc_rate_min_interval_s apart (1 s at least)
    simulate(tmp_path, ecc_corrected=50_000)
    spare.deliver(recorder)
    spare.judge(spare.check())
    ((event, fields),) = recorder.reports
    assert event == "health_warning" and "ECC" in fields["summary"], fields

    started_late = HealthAgent(Recorder(), "c3", interval=1.0)  # what an agent started at promotion saw
    (tmp_path / "c3.json").write_text((tmp_path / "c2.json").read_text())
    started_late.judge(started_late.check())
    assert not started_late.reported


# --- the thread: started on local rank 0 only, stopped by close() ----------------------


def test_maybe_start_runs_only_on_local_rank_0_with_an_interval(
    health_env: Path, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHPASS_HEALTH_INTERVAL", "0")
    assert HealthAgent.maybe_start(recorder, node="c2", local_rank=0) is None
    monkeypatch.setenv("TORCHPASS_HEALTH_INTERVAL", "3600")
    assert HealthAgent.maybe_start(recorder, node="c2", local_rank=1) is None
    agent = HealthAgent.maybe_start(recorder, node="c2", local_rank=0)
    assert agent is not None and agent.is_alive() and agent.interval == 3600
    agent.close()
    assert not agent.is_alive()


def test_close_stops_a_waiting_agent_at_once(agent: HealthAgent, tmp_path: Path) -> None:
    simulate(tmp_path)
    agent.interval = 3600.0  # it sleeps between checks: close() must wake it
    agent.start()
    started = time.monotonic()
    agent.close()
    assert not agent.is_alive()
    assert time.monotonic() - started < 1.0
    agent.close()  # idempotent


def test_close_stops_a_checking_agent_and_nothing_is_reported_after(
    agent: HealthAgent, recorder: Recorder, tmp_path: Path
) -> None:
    simulate(tmp_path, temperature_c=86)  # a warning, were it judged
    agent.interval = 0.01
    checking, release = threading.Event(), threading.Event()
    real_check = agent.check

    def slow_check() -> HealthReport:
        checking.set()
        release.wait(5)
        return real_check()

    agent.check = slow_check  # type: ignore[method-assign]
    agent.start()
    assert checking.wait(5)
    started = time.monotonic()
    agent.close(timeout=0.1)  # the check is still running: close() waits only this long
    assert 0.1 <= time.monotonic() - started < 1.0
    assert agent.is_alive()
    release.set()
    agent.join(5)
    assert not agent.is_alive()
    assert recorder.reports == []  # closed while checking: the rank is leaving


def test_a_running_agent_reports_through_the_callable_then_stops(
    agent: HealthAgent, recorder: Recorder, tmp_path: Path
) -> None:
    simulate(tmp_path, temperature_c=86)
    agent.interval = 0.01
    agent.start()
    wait_for(lambda: recorder.reports)
    agent.close()
    assert not agent.is_alive()
    assert [event for event, _ in recorder.reports] == ["health_warning"]


def test_the_close_timeout_is_a_named_bounded_setting() -> None:
    assert 0 < CLOSE_TIMEOUT_S <= 30


# --- with the rank runtime ----------------------------------------------------------------


class FakeClient:
    """The least a Runtime needs of its control client."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def send(self, kind: str, body: dict[str, Any]) -> None:
        self.sent.append((kind, body))

    def recv(self, timeout: datetime.timedelta) -> None:
        time.sleep(min(timeout.total_seconds(), 0.01))

    def close(self) -> None:
        pass


def health_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "torchpass-health"]


def active_runtime(client: FakeClient) -> Any:
    """An active rank on local rank 0 of c2, started (so its agent runs, if the interval says so)."""
    from torchpass_slurm.config import SupervisorConfig
    from torchpass_slurm.rank import runtime

    env = {
        "TORCHPASS_CONTROL": "tcp://ctl:5555",
        "TORCHPASS_SECRET_FILE": "/run/secret",
        "TORCHPASS_ROLE": "active",
        "TORCHPASS_JOB_ID": "42",
        "TORCHPASS_NODE": "c2",
        "TORCHPASS_EPOCH": "3",
        "TORCHPASS_NTASKS_PER_NODE": "1",
        "SLURM_LOCALID": "0",
        "TORCHPASS_RANK_BASE": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "c1",
        "MASTER_PORT": "1",
    }
    return runtime.init(
        env, client_factory=lambda *_: client, config=SupervisorConfig(heartbeat_interval=0.01)
    )


def test_runtime_close_stops_its_agent(health_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    simulate(health_env)  # healthy: the agent would check forever
    monkeypatch.setenv("TORCHPASS_HEALTH_INTERVAL", "0.01")
    before = set(health_threads())
    rt = active_runtime(FakeClient())
    try:
        assert len(set(health_threads()) - before) == 1
        time.sleep(0.05)  # a few checks
    finally:
        rt.close()
    assert set(health_threads()) <= before


def test_the_runtime_passes_its_report_to_the_agent(
    health_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    simulate(health_env, temperature_c=86)
    monkeypatch.setenv("TORCHPASS_HEALTH_INTERVAL", "0.01")
    client = FakeClient()
    rt = active_runtime(client)
    try:
        wait_for(lambda: any(kind == "report" for kind, _ in client.sent))
    finally:
        rt.close()
    [report] = [body for kind, body in client.sent if kind == "report"]
    assert report["event"] == "health_warning" and report["fields"]["node"] == "c2"
    assert report["fields"]["rank"] == 0
