"""The GPU signal table: every row's verdict, the defaults, and the judging of a reading (pure)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from torchpass_slurm.health.gpu_signals import (
    DEFAULTS,
    RULES,
    Finding,
    GpuReading,
    Kind,
    Verdict,
    judge_amd_event,
    judge_event,
    judge_reading,
    judge_recovery_action,
    judge_xid,
    reading_from_facts,
    summary,
    worst,
)

from .conftest import APP, MOVE, NONE, PLAN, UNKNOWN, gpu

#: The issue's table, written out here (not read from RULES, so a changed row fails).
XIDS = {
    13: APP, 31: APP, 43: APP, 45: APP, 94: APP,
    46: MOVE, 48: MOVE, 62: MOVE, 64: MOVE, 79: MOVE, 95: MOVE, 119: MOVE, 120: MOVE, 140: MOVE,
    63: PLAN, 74: PLAN, 92: PLAN, 154: PLAN,
    144: PLAN, 145: PLAN, 146: PLAN, 147: PLAN, 148: PLAN, 149: PLAN, 150: PLAN,
}  # fmt: skip
RECOVERY_ACTIONS = {0: NONE, 1: MOVE, 2: MOVE, 3: PLAN, 4: PLAN, 5: PLAN, 6: MOVE, 7: MOVE}
NVML_EVENTS = {
    0x1: NONE, 0x2: MOVE, 0x200: PLAN, 0x400: PLAN, 0x800: MOVE,
    0x1000: APP, 0x2000: MOVE, 0x4000: MOVE, 0x8000: NONE,
}  # fmt: skip
THROTTLE = {
    "gpu_idle": NONE, "applications_clocks_setting": NONE, "sw_power_cap": NONE, "hw_slowdown": PLAN,
    "sync_boost": NONE, "sw_thermal_slowdown": NONE, "hw_thermal_slowdown": PLAN,
    "hw_power_brake_slowdown": PLAN, "display_clock_setting": NONE,
}  # fmt: skip
AMD_EVENTS = {1: APP, 2: PLAN, 3: MOVE, 4: NONE}


def keys(kind: Kind) -> set[int | str]:
    return {r.key for r in RULES if r.kind == kind}


def test_the_table_has_exactly_the_rows_of_the_issue() -> None:
    assert keys(Kind.XID) == set(XIDS)
    assert keys(Kind.RECOVERY_ACTION) == set(RECOVERY_ACTIONS)
    assert keys(Kind.NVML_EVENT) == set(NVML_EVENTS)
    assert keys(Kind.THROTTLE) == set(THROTTLE)
    assert keys(Kind.AMD_EVENT) == set(AMD_EVENTS)


def test_every_row_has_one_key_a_reason_and_a_source() -> None:
    pairs = [(r.kind, r.key) for r in RULES]
    assert len(pairs) == len(set(pairs))
    for row in (*RULES, *DEFAULTS.values()):
        assert row.reason and row.source and row.name, row


@pytest.mark.parametrize(("code", "verdict"), sorted(XIDS.items()))
def test_xid(code: int, verdict: Verdict) -> None:
    found = judge_xid(2, code)
    assert (found.gpu, found.verdict) == (2, verdict)
    assert found.signal.startswith(f"xid {code} ")


def test_an_unlisted_xid_plans_a_move_and_says_why() -> None:
    found = judge_xid(0, 61)
    assert (found.signal, found.verdict) == ("xid 61 (unlisted)", PLAN)
    assert "does not know" in found.reason


@pytest.mark.parametrize(("action", "verdict"), sorted(RECOVERY_ACTIONS.items()))
def test_recovery_action(action: int, verdict: Verdict) -> None:
    assert judge_recovery_action(0, action).verdict == verdict


def test_an_unlisted_recovery_action_plans_a_move() -> None:
    assert judge_recovery_action(0, 9).verdict == PLAN


@pytest.mark.parametrize(("event_type", "verdict"), sorted(NVML_EVENTS.items()))
def test_nvml_event(event_type: int, verdict: Verdict) -> None:
    [found] = judge_event(0, event_type, 0)
    assert found.verdict == verdict


def test_the_xid_event_is_judged_by_its_code() -> None:
    assert [f.verdict for f in judge_event(1, 0x8, 79)] == [MOVE]
    assert [f.verdict for f in judge_event(1, 0x8, 13)] == [APP]
    assert [f.verdict for f in judge_event(1, 0x10, 0)] == [NONE]  # Clock: not registered for


@pytest.mark.parametrize(("event_type", "verdict"), sorted(AMD_EVENTS.items()))
def test_amd_event(event_type: int, verdict: Verdict) -> None:
    assert judge_amd_event(0, event_type).verdict == verdict
    assert judge_amd_event(0, 99).verdict == NONE


def verdicts(now: GpuReading, before: GpuReading | None = None) -> dict[str, Verdict]:
    return {f.signal: f.verdict for f in judge_reading(now, before)}


def test_a_healthy_reading_finds_nothing() -> None:
    healthy = GpuReading(0, recovery_action=0, ecc_uncorrected=0, throttle_reasons=("gpu_idle",))
    assert verdicts(healthy, healthy) == {"recovery_action 0 NONE": NONE, "throttle gpu_idle": NONE}


def test_uncorrectable_ecc_new_moves_now_standing_plans() -> None:
    first = GpuReading(0, ecc_uncorrected=2)
    assert verdicts(first) == {"2 uncorrectable ECC error(s)": PLAN}
    assert verdicts(first, first) == {}
    assert verdicts(GpuReading(0, ecc_uncorrected=3), first) == {"1 new uncorrectable ECC error(s)": MOVE}
    assert verdicts(GpuReading(0, ecc_uncorrected=None), first) == {}


def test_remaps() -> None:
    assert verdicts(GpuReading(0, remapped_rows_pending=True)) == {"remap pending": PLAN}
    assert verdicts(GpuReading(0, remapped_rows_failure=True)) == {"remap failure": MOVE}
    assert verdicts(GpuReading(0, retirement_pending=True)) == {"remap retirement_pending": PLAN}


@pytest.mark.parametrize(("name", "verdict"), sorted(THROTTLE.items()))
def test_a_throttle_reason_counts_on_its_second_reading(name: str, verdict: Verdict) -> None:
    now = GpuReading(0, throttle_reasons=(name,))
    assert verdicts(now) == {}
    assert verdicts(now, GpuReading(0, throttle_reasons=())) == {}
    assert verdicts(now, now) == {f"throttle {name}": verdict}


def test_a_lost_gpu_moves_now_and_nothing_else_is_judged() -> None:
    assert verdicts(GpuReading(0, lost=True, remapped_rows_pending=True)) == {"GPU lost": MOVE}


def test_a_failed_read_is_unknown_never_a_move() -> None:
    broken = GpuReading(0, errors=(("ecc_uncorrected", "NVMLError: NVML error 999"),))
    assert verdicts(broken) == {"read ecc_uncorrected": UNKNOWN}


def test_readings_from_other_sources() -> None:
    """AMD SMI and the simulated source give GpuFacts: the same rows judge them."""
    amd = gpu(0, ecc_uncorrected=1, retired_pages_pending=True, throttle_reasons=None)
    reading = reading_from_facts(amd)
    assert verdicts(reading, reading_from_facts(gpu(0))) == {
        "1 new uncorrectable ECC error(s)": MOVE,
        "remap retirement_pending": PLAN,
    }


def test_worst_and_summary() -> None:
    app = Finding(0, "xid 13 GR_EXCEPTION", APP, "r")
    plan = Finding(1, "remap pending", PLAN, "r")
    move = Finding(None, "xid 79 GPU_HAS_FALLEN_OFF_THE_BUS", MOVE, "r")
    unknown = Finding(0, "read x", UNKNOWN, "r")
    assert worst([]) == NONE
    assert worst([unknown, app]) == APP
    assert worst([app, plan, unknown]) == PLAN
    assert worst([plan, move, app]) == MOVE
    assert summary([plan, move], MOVE) == "GPU ? xid 79 GPU_HAS_FALLEN_OFF_THE_BUS: move now"
    assert str(plan) == "GPU 1 remap pending: plan move (r)"


def test_the_admin_guide_shows_every_row() -> None:
    """The docs table is the code's table: every XID, action, throttle reason and its verdict."""
    guide = (Path(__file__).resolve().parents[3] / "docs" / "admin-guide.md").read_text()
    section = guide.split("## GPU fault signals", 1)[1].split("\n## ", 1)[0]
    rows = {
        (m.group(1), m.group(2).strip(), m.group(3))
        for m in re.finditer(r"^\| (\w+) \| ([^|]+) \|[^|]*\| `(\w+)` \|", section, re.MULTILINE)
    }
    for row in RULES:
        key = hex(int(row.key)) if row.kind == Kind.NVML_EVENT else str(row.key)
        if row.kind == Kind.XID and 144 <= int(row.key) <= 150:
            key = "144-150"
        assert (row.kind.value, key, row.verdict.value) in rows, row
