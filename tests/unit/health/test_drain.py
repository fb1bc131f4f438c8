"""Drain etiquette: reasons, the Prolog/Epilog decision, HealthCheckProgram, undrain."""

from __future__ import annotations

from pathlib import Path

from torchpass_slurm.health.admin import node_check, prolog
from torchpass_slurm.health.checks import CheckResult, Status
from torchpass_slurm.health.config import HealthConfig
from torchpass_slurm.health.drain import drain_reason, is_ours, plan_undrain, undrain
from torchpass_slurm.health.run import HealthReport
from torchpass_slurm.health.state import drained_marker, set_drained_marker
from torchpass_slurm.slurm import Node

from .conftest import NOW, FakeSlurm


def report(*results: tuple[Status, str, str]) -> HealthReport:
    rows = tuple(CheckResult(check, status, message) for status, check, message in results)
    return HealthReport("n1", "simulated", NOW, 0.1, rows or (CheckResult("gpu_count", Status.OK, "fine"),))


LOST = (Status.CRITICAL, "gpu_count", "3 GPU(s) working, expected 4")
BROKEN = (Status.UNKNOWN, "gpu_temperature", "no GPU facts: NVML did not initialise")
HOT = (Status.WARNING, "gpu_temperature", "GPU 0: 85 C (warning at 83 C, critical at 88 C)")


def test_reasons() -> None:
    cfg = HealthConfig()
    assert drain_reason(report(LOST), cfg) == "torchpass: gpu_count: 3 GPU(s) working, expected 4"
    assert drain_reason(report(LOST, LOST, BROKEN), cfg) == (
        "torchpass: gpu_count: 3 GPU(s) working, expected 4 (+1 more)"
    )
    assert drain_reason(report(BROKEN, HOT), cfg) is None
    assert drain_reason(report(BROKEN), HealthConfig(drain_on_unknown=True)) == (
        "torchpass: check failed: gpu_temperature: no GPU facts: NVML did not initialise"
    )
    long = (Status.CRITICAL, "host_disk", "x" * 500)
    assert len(drain_reason(report(long), cfg) or "") == 120
    assert is_ours("torchpass: x") and not is_ours("Prolog error") and not is_ours(None)


def test_prolog_critical_drains_once_and_fails() -> None:
    slurm = FakeSlurm()
    outcome = prolog(report(LOST), HealthConfig(), lambda: slurm)
    assert slurm.calls == [("drain", "n1", "torchpass: gpu_count: 3 GPU(s) working, expected 4")]
    assert (outcome.exit_code, outcome.drained) == (1, True)
    assert outcome.message == "drained n1: torchpass: gpu_count: 3 GPU(s) working, expected 4"


def test_prolog_unknown_and_warning_never_drain() -> None:
    slurm = FakeSlurm()
    for r in (report(BROKEN), report(HOT), report()):
        assert prolog(r, HealthConfig(), lambda: slurm).exit_code == 0
    assert slurm.calls == []
    assert prolog(report(), HealthConfig(), lambda: slurm).message is None  # OK: quiet


def test_prolog_unknown_drains_when_the_admin_chose_so() -> None:
    slurm = FakeSlurm()
    outcome = prolog(report(BROKEN), HealthConfig(drain_on_unknown=True), lambda: slurm)
    assert outcome.exit_code == 1
    assert slurm.calls == [
        ("drain", "n1", "torchpass: check failed: gpu_temperature: no GPU facts: NVML did not initialise")
    ]


def test_prolog_drain_left_to_slurmd_runs_no_slurm_command() -> None:
    slurm = FakeSlurm()
    outcome = prolog(report(LOST), HealthConfig(prolog_drain="slurmd"), lambda: slurm)
    assert (outcome.exit_code, outcome.drained, slurm.calls) == (1, False, [])
    assert outcome.message == "torchpass: gpu_count: 3 GPU(s) working, expected 4 (slurmd drains the node)"


def test_node_check_drains_once_and_resumes_only_its_own(tmp_path: Path) -> None:
    cfg = HealthConfig(state_file=str(tmp_path / "state.json"), auto_resume=True)
    slurm = FakeSlurm([Node("n1", "IDLE")])
    outcome = node_check(report(LOST), cfg, lambda: slurm, now=NOW)
    assert outcome.exit_code == 2 and outcome.drained
    assert slurm.changes() == [("drain", "n1", "torchpass: gpu_count: 3 GPU(s) working, expected 4")]
    assert drained_marker(cfg.state_file) == "torchpass: gpu_count: 3 GPU(s) working, expected 4"

    slurm.known = [
        Node("n1", "IDLE", frozenset({"DRAIN"}), "torchpass: gpu_count: 3 GPU(s) working, expected 4")
    ]
    assert not node_check(
        report(LOST), cfg, lambda: slurm, now=NOW
    ).drained  # already drained: no second drain
    outcome = node_check(report(), cfg, lambda: slurm, now=NOW)
    assert outcome.message == (
        "torchpass: resumed n1, OK again (was: torchpass: gpu_count: 3 GPU(s) working, expected 4)"
    )
    assert slurm.changes()[1:] == [("resume", "n1")]
    assert drained_marker(cfg.state_file) is None


def test_node_check_leaves_an_admin_drain_alone(tmp_path: Path) -> None:
    cfg = HealthConfig(state_file=str(tmp_path / "state.json"), auto_resume=True)
    slurm = FakeSlurm([Node("n1", "IDLE", frozenset({"DRAIN"}), "bad DIMM, ticket 42")])
    outcome = node_check(report(LOST), cfg, lambda: slurm, now=NOW)
    assert "already drained by an admin: 'bad DIMM, ticket 42'; left as is" in (outcome.message or "")
    set_drained_marker(cfg.state_file, "torchpass: old", NOW)  # stale marker: the admin re-drained since
    node_check(report(), cfg, lambda: slurm, now=NOW)
    assert slurm.changes() == []


def test_node_check_ok_asks_slurm_nothing(tmp_path: Path) -> None:
    slurm = FakeSlurm()
    cfg = HealthConfig(state_file=str(tmp_path / "s.json"), auto_resume=True)
    assert node_check(report(), cfg, lambda: slurm, now=NOW).exit_code == 0
    assert node_check(report(BROKEN), cfg, lambda: slurm, now=NOW).exit_code == 3
    assert slurm.calls == []


def test_undrain_plan_touches_only_torchpass_reasons() -> None:
    nodes = [
        Node("n1", "IDLE", frozenset({"DRAIN"}), "torchpass: gpu_count: 3 GPU(s) working, expected 4"),
        Node("n2", "IDLE", frozenset({"DRAIN"}), "Prolog error"),
        Node("n3", "MIXED"),
        Node("n4", "MIXED", frozenset({"DRAIN"}), "  torchpass: host_disk: /tmp: 3 MB free"),
    ]
    steps = plan_undrain(nodes)
    assert [(s.node, s.action, s.why) for s in steps] == [
        ("n1", "resume", "drained by torchpass"),
        ("n2", "skip", "drained for another reason (not torchpass)"),
        ("n4", "resume", "drained by torchpass"),
    ]
    named = plan_undrain(nodes, ["n3", "n9"])
    assert [(s.node, s.action, s.why) for s in named] == [
        ("n3", "skip", "not drained (MIXED)"),
        ("n9", "skip", "Slurm knows no such node"),
    ]
    slurm = FakeSlurm(nodes)
    undrain(slurm, steps, dry_run=True)
    assert slurm.calls == []
    undrain(slurm, steps)
    assert slurm.calls == [("resume", "n1"), ("resume", "n4")]
