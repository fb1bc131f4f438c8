"""The goodput model: the study's examples, the closed form against the simulation, the CLI."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from tests.unit.cli.conftest import tp
from torchpass_slurm.goodput import GoodputParams, ettr, ettr_first_order, simulate

CR = GoodputParams().checkpoint_restart()


@pytest.mark.parametrize(("interval_s", "published"), [(3600.0, 0.70), (300.0, 0.93)])
def test_reproduces_the_studys_16384_gpu_examples(interval_s: float, published: float) -> None:
    p = replace(CR, ckpt_interval_s=interval_s)
    assert ettr(16384, p).ettr == pytest.approx(published, abs=0.03)
    assert ettr_first_order(16384, p) == pytest.approx(published, abs=0.03)


@pytest.mark.parametrize(("gpus", "params"), [
    (16384, CR),
    (1024, replace(CR, ckpt_interval_s=600.0, ckpt_write_s=60.0)),
    (16384, GoodputParams()),
    (131072, replace(GoodputParams(), live_coverage=0.5, ckpt_interval_s=900.0, ckpt_write_s=30.0)),
])
def test_monte_carlo_agrees_with_the_closed_form_within_2_percent(gpus: int, params: GoodputParams) -> None:
    closed = ettr(gpus, params).ettr
    assert simulate(gpus, params, seed=1).ettr == pytest.approx(closed, rel=0.02)


def test_full_coverage_costs_only_the_recovery_and_the_writes() -> None:
    p = GoodputParams(live_coverage=1.0, ckpt_write_s=36.0)
    lam = p.fault_rate_per_s(16384)
    assert ettr(16384, p).ettr == pytest.approx(3600 / 3636 * math.exp(-lam * 30.0))


def test_no_faults_leaves_only_the_checkpoint_writes() -> None:
    p = GoodputParams(failure_rate_per_node_day=0.0, ckpt_write_s=36.0)
    assert ettr(1024, p).ettr == pytest.approx(3600 / 3636)
    assert simulate(1024, p).ettr == pytest.approx(3600 / 3636)


def test_lost_gpu_hours_are_the_lost_share_of_the_job() -> None:
    g = ettr(1024, CR)
    assert g.lost_gpu_hours_per_day == pytest.approx((1 - g.ettr) * 1024 * 24)
    assert g.nodes == 128 and g.faults_per_day == pytest.approx(128 * 5.6e-3)


def test_bad_parameters_say_what_was_seen() -> None:
    with pytest.raises(ValueError, match="live_coverage must be in \\[0, 1\\], got 1.5"):
        GoodputParams(live_coverage=1.5)


def test_cli_json() -> None:
    out = tp("goodput", "--gpus", "16384", "--ckpt-interval", "5", "--json")
    assert out.code == 0, out.err
    data = json.loads(out.out)
    (row,) = data["rows"]
    assert row["gpus"] == 16384 and row["nodes"] == 2048
    assert row["checkpoint_restart"]["ettr"] == pytest.approx(0.93, abs=0.03)
    assert row["live_migration"]["ettr"] > row["checkpoint_restart"]["ettr"]


def test_cli_table_lists_the_three_default_sizes() -> None:
    out = tp("goodput")
    assert out.code == 0, out.err
    for size in ("1,024", "16,384", "131,072"):
        assert size in out.out


def test_cli_rejects_a_coverage_above_one() -> None:
    out = tp("goodput", "--live-coverage", "2")
    assert out.code == 2
    assert "--live-coverage" in out.err
