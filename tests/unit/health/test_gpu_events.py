"""The NVML event waiter against recorded NVML answers (tests/fixtures/nvml), and the agent's wiring."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from torchpass_slurm.health import gpu_events
from torchpass_slurm.health.gpu_events import NvmlEventWaiter
from torchpass_slurm.health.gpu_signals import Finding, Verdict
from torchpass_slurm.rank.health_agent import HealthAgent

from . import fake_nvml
from .conftest import APP, MOVE, NONE, PLAN, UNKNOWN
from .fake_nvml import FakeNvml

#: the event types the waiter registers for: critical XID, DBE, SBE storm, DRAM retirement event and
#: failure, non-fatal and fatal poison, GPU unavailable, recovery action (not SBE, PState, Clock, ...)
REGISTERED = 0x8 | 0x2 | 0x200 | 0x400 | 0x800 | 0x1000 | 0x2000 | 0x4000 | 0x8000


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Run:
    """A waiter on a fixture, driven step by step; ``batches`` is what it handed over."""

    def __init__(self, fixture: str, interval: float = 10.0) -> None:
        self.nvml: FakeNvml = fake_nvml.load(fixture)
        self.clock = Clock()
        self.batches: list[list[Finding]] = []
        self.waiter = NvmlEventWaiter(
            self.batches.append, interval=interval, module=self.nvml, wait_ms=1, clock=self.clock
        )

    def step(self, advance: float = 0.0) -> list[tuple[int | None, str, Verdict]]:
        """One step after ``advance`` seconds: the findings it handed over."""
        self.clock.now += advance
        before = len(self.batches)
        self.waiter.step()
        return [(f.gpu, f.signal, f.verdict) for batch in self.batches[before:] for f in batch]

    def all(self) -> list[Finding]:
        return [f for batch in self.batches for f in batch]


def test_a_healthy_node_registers_for_its_events_and_finds_nothing() -> None:
    run = Run("healthy")
    assert run.waiter.open()
    assert [c for c in run.nvml.calls if c[0] == "register"] == [
        ("register", 0, REGISTERED, "set-1"),
        ("register", 1, REGISTERED, "set-1"),
    ]
    assert run.step() == [(0, "recovery_action 0 NONE", NONE), (1, "recovery_action 0 NONE", NONE)]
    assert run.step(5) == []  # a wait that timed out; the next read is not due
    assert run.step(6) == []  # read again: nothing new (each finding is handed over once)
    run.waiter.shut()
    assert run.nvml.calls[-2:] == [("free", "set-1"), ("shutdown",)]


XID_VERDICTS = {
    13: APP, 31: APP, 43: APP, 48: MOVE, 62: MOVE, 63: PLAN, 64: MOVE, 74: PLAN,
    79: MOVE, 92: PLAN, 94: APP, 95: MOVE, 119: MOVE, 120: MOVE, 154: PLAN, 999: PLAN,
}  # fmt: skip


def test_critical_xid_events_are_judged_by_their_code() -> None:
    run = Run("xid_events")
    assert run.waiter.open()
    seen: dict[int, Verdict] = {}
    for code in XID_VERDICTS:
        xids = [(g, s, v) for g, s, v in run.step() if s.startswith("xid ")]
        assert [(g, s.split()[1]) for g, s, _ in xids] == [(1, str(code))]
        seen[code] = xids[0][2]
    assert seen == XID_VERDICTS


def test_a_double_bit_ecc_event_moves_now() -> None:
    run = Run("dbe_event")
    assert run.waiter.open()
    run.step()  # the first read: no errors
    assert [(g, v) for g, s, v in run.step() if v != NONE] == [(0, MOVE), (0, MOVE)]
    assert {f.signal for f in run.all() if f.verdict == MOVE} == {
        "event DoubleBitEccError",
        "1 new uncorrectable ECC error(s)",
    }


def test_each_recovery_action_announced_by_its_event() -> None:
    run = Run("recovery_action")
    assert run.waiter.open()
    got = []
    for _ in range(9):
        got += [(s, v) for g, s, v in run.step() if g == 0 and s.startswith("recovery_action")]
    assert got == [
        ("recovery_action 0 NONE", NONE),
        ("recovery_action 1 GPU_RESET", MOVE),
        ("recovery_action 2 NODE_REBOOT", MOVE),
        ("recovery_action 3 DRAIN_P2P", PLAN),
        ("recovery_action 4 DRAIN_AND_RESET", PLAN),
        ("recovery_action 5 RECOVER_IMEX_DOMAIN", PLAN),
        ("recovery_action 6 BUS_RESET", MOVE),
        ("recovery_action 7 SYSTEM_REBOOT", MOVE),
        ("recovery_action 9 (unlisted)", PLAN),
    ]


def test_fields_a_driver_does_not_support_are_not_reported() -> None:
    run = Run("driver_before_570")
    assert run.waiter.open()
    assert run.step() == []


def test_remaps() -> None:
    run = Run("remap")
    assert run.waiter.open()
    assert [(g, s, v) for g, s, v in run.step() if v != NONE] == [
        (0, "remap pending", PLAN),
        (1, "remap failure", MOVE),
    ]


def test_throttle_reasons_count_when_they_hold() -> None:
    run = Run("throttle")
    assert run.waiter.open()
    assert [s for _, s, _ in run.step() if s.startswith("throttle")] == []
    assert [(g, s, v) for g, s, v in run.step(10) if s.startswith("throttle")] == [
        (0, "throttle hw_slowdown", PLAN),
        (0, "throttle hw_thermal_slowdown", PLAN),
        (1, "throttle sw_power_cap", NONE),
    ]
    assert run.step(10) == []  # sw_thermal_slowdown was seen once only


def test_a_gpu_lost_moves_now() -> None:
    run = Run("gpu_lost")
    assert run.waiter.open()
    run.step()
    assert [(g, s, v) for g, s, v in run.step(10) if v != NONE] == [(1, "GPU lost", MOVE)]


def test_without_events_the_waiter_polls() -> None:
    run = Run("events_not_supported")
    assert run.waiter.open()
    assert run.batches == [[Finding(None, "NVML events", UNKNOWN, "polling only: NVMLError: NVML error 3")]]
    assert [(g, s, v) for g, s, v in run.step() if v != NONE] == [(0, "remap pending", PLAN)]


def test_nvml_missing_is_one_unknown() -> None:
    run = Run("nvml_missing")
    assert not run.waiter.open()
    assert run.all() == [Finding(None, "NVML", UNKNOWN, "NVML unusable: NVMLError: NVML error 12")]


def test_pynvml_not_installed_is_one_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    found: list[Sequence[Finding]] = []
    waiter = NvmlEventWaiter(found.append, interval=1)
    waiter.run()  # returns at once
    [[only]] = found
    assert (only.verdict, only.signal) == (UNKNOWN, "NVML")
    assert only.reason.startswith("NVML unusable: ModuleNotFoundError")


def test_a_wait_that_fails_is_unknown_once_and_does_not_spin() -> None:
    run = Run("wait_fails")
    assert run.waiter.open()
    started = time.monotonic()
    for _ in range(3):
        run.step()
    assert time.monotonic() - started >= 0.003  # each failed wait slept wait_ms
    assert [(f.signal, f.verdict) for f in run.all() if f.verdict != NONE] == [("wait for events", UNKNOWN)]


def test_a_broken_binding_is_unknown_never_a_move() -> None:
    run = Run("broken_binding")
    assert run.waiter.open()
    run.step()
    run.step()
    found = {(f.signal, f.verdict) for f in run.all()}
    assert found == {
        ("wait for events", UNKNOWN),
        ("read ecc_uncorrected", UNKNOWN),
        ("read recovery_action", UNKNOWN),
        ("event data", UNKNOWN),
    }


def test_the_thread_stops_within_a_wait() -> None:
    nvml = fake_nvml.load("healthy")
    waiter = NvmlEventWaiter(lambda findings: None, interval=0.01, module=nvml, wait_ms=20)
    waiter.start()
    time.sleep(0.05)
    started = time.monotonic()
    waiter.close(timeout=2)
    assert not waiter.is_alive() and time.monotonic() - started < 1
    assert nvml.calls[-2:] == [("free", "set-1"), ("shutdown",)]


# -- the agent: verdicts become the existing health_warning report --------------------------------


class Recorder:
    def __init__(self) -> None:
        self.reports: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, event: str, **fields: Any) -> None:
        self.reports.append((event, fields))


def test_move_now_is_reported_critical_and_urgent_once() -> None:
    recorder = Recorder()
    agent = HealthAgent(recorder, "c2", interval=1.0)
    agent.on_gpu_findings(
        [Finding(1, "xid 13 GR_EXCEPTION", APP, "r"), Finding(1, "remap pending", PLAN, "r")]
    )
    agent.on_gpu_findings([Finding(1, "xid 79 GPU_HAS_FALLEN_OFF_THE_BUS", MOVE, "r")])
    assert recorder.reports == [
        (
            "health_warning",
            {"node": "c2", "status": "WARNING", "summary": "gpu: GPU 1 remap pending: plan move"},
        )
    ]
    other = Recorder()
    agent = HealthAgent(other, "c3", interval=1.0)
    agent.on_gpu_findings([Finding(0, "xid 79 GPU_HAS_FALLEN_OFF_THE_BUS", MOVE, "r")])
    assert other.reports == [
        (
            "health_warning",
            {
                "node": "c3",
                "status": "CRITICAL",
                "summary": "gpu: GPU 0 xid 79 GPU_HAS_FALLEN_OFF_THE_BUS: move now",
                "move_now": True,
            },
        )
    ]


def test_app_faults_and_unknowns_are_logged_never_reported(caplog: pytest.LogCaptureFixture) -> None:
    recorder = Recorder()
    agent = HealthAgent(recorder, "c2", interval=1.0)
    agent.on_gpu_findings(
        [Finding(0, "xid 31 MMU_ERR_FLT", APP, "bad address"), Finding(None, "NVML", UNKNOWN, "x")]
    )
    assert recorder.reports == [] and not agent.reported
    assert "GPU 0 xid 31 MMU_ERR_FLT: app fault (bad address)" in caplog.text


def test_the_agent_starts_the_waiter_on_nvidia_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end in the agent: an XID 79 event on a recorded node -> health_warning CRITICAL."""
    nvml = fake_nvml.load("xid_events")
    nvml._waits = [{"device": 1, "eventType": 8, "eventData": 79}]
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(gpu_events, "nvml_available", lambda: True)
    monkeypatch.delenv("TORCHPASS_HEALTH_SIMULATE", raising=False)
    recorder = Recorder()
    agent = HealthAgent(recorder, "c2", interval=3600)
    agent.start_gpu_events()
    try:
        deadline = time.monotonic() + 5
        while not recorder.reports and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        agent.close(timeout=2)
    assert recorder.reports == [
        (
            "health_warning",
            {
                "node": "c2",
                "status": "CRITICAL",
                "summary": "gpu: GPU 1 xid 79 GPU_HAS_FALLEN_OFF_THE_BUS: move now",
                "move_now": True,
            },
        )
    ]
    assert agent.gpu_events is not None and not agent.gpu_events.is_alive()


def test_no_waiter_when_the_gpus_are_simulated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TORCHPASS_HEALTH_SIMULATE", str(tmp_path / "{node}.json"))
    monkeypatch.setattr(gpu_events, "nvml_available", lambda: True)
    agent = HealthAgent(Recorder(), "c2", interval=1.0)
    agent.start_gpu_events()
    assert agent.gpu_events is None
