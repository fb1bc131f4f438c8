"""The pre-emptive drain reason: one builder (``faults.py``, re-exported by ``health/drain.py``),
used by the planner, recognised by the report and undrainable by ``tp health undrain``."""

from __future__ import annotations

from torchpass_slurm.faults import (
    MAX_DRAIN_REASON,
    Detector,
    Fault,
    drain_reason_text,
    is_pre_emptive_drain,
    pre_emptive_drain_reason,
)
from torchpass_slurm.health import drain
from torchpass_slurm.supervisor.membership import Membership
from torchpass_slurm.supervisor.plan import Action, Policy, WorkerFacts, plan_recovery


def test_the_planner_drains_with_the_one_builders_reason() -> None:
    fault = Fault("n2", Detector.HEALTH_WARNING, "WARNING: GPU 0: 40 corrected ECC errors in 60 s")
    m = Membership(0, 2, ("n1", "n2"), ("s1",))
    facts = {n: WorkerFacts(live=True, running=True, usable=True) for n in ("n1", "n2", "s1")}
    plan = plan_recovery([fault], m, facts, Policy(batch_host="n1"))
    assert plan.action == Action.DRAIN
    assert plan.detail == pre_emptive_drain_reason(fault.detail)
    assert plan.detail == "torchpass: pre-emptive: WARNING: GPU 0: 40 corrected ECC errors in 60 s"
    assert is_pre_emptive_drain(plan.detail) and drain.is_ours(plan.detail)


def test_a_long_reason_is_one_line_cut_to_the_one_limit() -> None:
    reason = pre_emptive_drain_reason("WARNING:\n" + "x" * 300)
    assert len(reason) == MAX_DRAIN_REASON == drain.MAX_REASON and reason.endswith("...")
    assert "\n" not in reason and is_pre_emptive_drain(reason)
    assert drain_reason_text("gpu: dead") == "torchpass: gpu: dead"
    assert drain.REASON_PREFIX == "torchpass:"


def test_only_a_pre_emptive_reason_is_pre_emptive() -> None:
    assert not is_pre_emptive_drain("torchpass: gpu: dead")
    assert not is_pre_emptive_drain("firmware update (pre-emptive)")
    assert not is_pre_emptive_drain(None)
    assert is_pre_emptive_drain("  torchpass:   pre-emptive: spaced out")
