"""Coverage from spares: Erlang B, the limits of the closed form, the closed form against
the simulation, and `tp goodput --spares` with good and hostile input."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from tests.unit.cli.conftest import tp
from torchpass_slurm.analysis.coverage import (
    SpareParams,
    blocking_upper,
    coverage,
    erlang_b,
    hold_error_bound,
    live_params,
    simulate_coverage,
)
from torchpass_slurm.analysis.goodput import GoodputParams, ettr

P = GoodputParams()
LAM_16K = P.fault_rate_per_s(16384)  # 13.31 faults a day


def erlang_b_direct(servers: int, load: float) -> float:
    """``(a^S / S!) / sum_k a^k / k!``: the textbook formula, fine for small S."""
    terms = [load**k / math.factorial(k) for k in range(servers + 1)]
    return terms[-1] / sum(terms)


# --- Erlang B ----------------------------------------------------------------------------------


@pytest.mark.parametrize("load", [0.0, 0.01, 0.5, 1.0, 7.0])
def test_erlang_b_of_one_server_is_a_over_one_plus_a(load: float) -> None:
    assert erlang_b(1, load) == pytest.approx(load / (1 + load))
    assert erlang_b(0, load) == 1.0


def test_erlang_b_matches_the_textbook_formula_and_tables() -> None:
    for servers in range(12):
        for load in (0.046, 0.5, 3.0, 20.0):
            assert erlang_b(servers, load) == pytest.approx(erlang_b_direct(servers, load), rel=1e-12)
    assert erlang_b(2, 1.0) == pytest.approx(0.2)
    assert erlang_b(10, 5.0) == pytest.approx(0.018385, abs=5e-6)  # the tables' 1.84 %


def test_erlang_b_stays_finite_where_the_textbook_formula_overflows() -> None:
    assert 0.0 < erlang_b(1000, 900.0) < 0.1  # 900^1000 overflows a float


def test_erlang_b_refuses_nonsense() -> None:
    for servers, load in ((-1, 1.0), (1, -0.5), (1, math.inf), (1, math.nan)):
        with pytest.raises(ValueError, match="got"):
            erlang_b(servers, load)


def test_blocking_bounds_enclose_and_meet_at_small_load() -> None:
    for servers in (1, 2, 3):
        for load in (1e-3, 0.046, 0.5, 2.0):
            assert erlang_b(servers, load) <= blocking_upper(servers, load)
        small = 1e-4
        leading = small**servers / math.factorial(servers)
        assert erlang_b(servers, small) == pytest.approx(leading, rel=1e-3)
        assert blocking_upper(servers, small) == pytest.approx(leading, rel=1e-3)
    assert blocking_upper(1, 0.5) == pytest.approx(1 - math.exp(-0.5))
    assert blocking_upper(0, 0.5) == 1.0


# --- the closed form's limits -----------------------------------------------------------------


def test_no_refill_covers_the_expected_share_of_the_first_s_faults() -> None:
    pool = SpareParams(spares=2, refill_s=None, job_days=3.0)
    lam = 1.0 / 86400  # 3 faults a job
    pmf = [math.exp(-3.0) * 3.0**k / math.factorial(k) for k in range(80)]
    expected_min = sum(min(k, 2) * p for k, p in enumerate(pmf))
    got = coverage(lam, pool)
    assert got.faults_per_job == pytest.approx(3.0)
    assert got.coverage == pytest.approx(0.98 * expected_min / 3.0)
    assert got.blocked == pytest.approx(1 - expected_min / 3.0)
    assert (got.held_covered, got.extra_pause_s) == (0.0, 0.0)


def test_no_refill_over_an_endless_job_covers_nothing() -> None:
    values = [
        coverage(LAM_16K, SpareParams(spares=2, refill_s=None, job_days=d)).coverage
        for d in (1.0, 14.0, 365.0, 3650.0)
    ]
    assert values == sorted(values, reverse=True)
    assert values[-1] < 1e-4
    # the S spares cover S faults (less the uncoverable share), however many come
    long = coverage(LAM_16K, SpareParams(spares=2, refill_s=None, job_days=3650.0))
    assert long.coverage * long.faults_per_job == pytest.approx(0.98 * 2)


def test_no_refill_over_a_job_without_faults_covers_all_it_can() -> None:
    pool = SpareParams(spares=1, refill_s=None)
    assert coverage(0.0, pool).coverage == pytest.approx(0.98)
    assert coverage(1e-15, pool).coverage == pytest.approx(0.98, rel=1e-6)


@pytest.mark.parametrize("spares", [1, 2])
def test_refill_in_no_time_covers_all_but_the_uncoverable(spares: int) -> None:
    exact = coverage(LAM_16K, SpareParams(spares=spares, refill_s=0.0))
    assert (exact.coverage, exact.blocked, exact.extra_pause_s) == (pytest.approx(0.98), 0.0, 0.0)
    near = [coverage(LAM_16K, SpareParams(spares=spares, refill_s=t)).coverage for t in (1e3, 1.0, 1e-6)]
    assert near == sorted(near) and near[-1] == pytest.approx(0.98, abs=1e-9)
    assert coverage(LAM_16K, SpareParams(spares=spares, refill_s=0.0, uncoverable=0.1)).coverage == 0.9


def test_no_spare_covers_nothing() -> None:
    for refill in (None, 11.0):
        assert coverage(LAM_16K, SpareParams(spares=0, refill_s=refill)).coverage == 0.0


def test_a_wait_as_long_as_the_refill_covers_every_held_fault() -> None:
    """Deterministic T, W >= T: the earliest of S uniform residuals always comes, after T/(S+1)."""
    for spares in (1, 2, 3):
        got = coverage(LAM_16K, SpareParams(spares=spares, refill_s=300.0, spare_wait_s=300.0))
        blocked = erlang_b(spares, LAM_16K * 300.0)
        assert got.blocked == pytest.approx(blocked)
        assert (got.held_covered, got.mean_wait_s) == (1.0, pytest.approx(300.0 / (spares + 1)))
        assert got.coverage == pytest.approx(0.98)
        assert got.extra_pause_s == pytest.approx(blocked * 300.0 / (spares + 1))


@pytest.mark.parametrize("spares", [1, 2, 4])
def test_a_shorter_wait_covers_the_held_faults_whose_refill_comes_in_time(spares: int) -> None:
    """p_W and E_W against a numerical integral of the minimum of S uniforms on [0, T]."""
    t, w = 600.0, 200.0
    got = coverage(1 / 1200, SpareParams(spares=spares, refill_s=t, spare_wait_s=w, uncoverable=0.0))
    n = 200_000
    xs = [(i + 0.5) * w / n for i in range(n)]
    density = [spares / t * (1 - x / t) ** (spares - 1) for x in xs]
    p_w = sum(density) * w / n
    assert got.held_covered == pytest.approx(1 - (1 - w / t) ** spares)
    assert got.held_covered == pytest.approx(p_w, rel=1e-6)
    mean = sum(x * d for x, d in zip(xs, density, strict=True)) * w / n / p_w
    assert got.mean_wait_s == pytest.approx(mean, rel=1e-6)
    blocked = erlang_b(spares, 0.5)
    assert got.coverage == pytest.approx(1 - blocked + blocked * got.held_covered)


def test_live_params_lengthen_the_pause_by_the_mean_wait() -> None:
    pool = SpareParams(spares=1, refill_s=300.0)
    cov, live = live_params(16384, P, pool)
    assert live.live_coverage == cov.coverage == pytest.approx(0.98)
    assert live.live_recovery_s == pytest.approx(P.live_recovery_s + cov.extra_pause_s)
    assert 6.0 < cov.extra_pause_s < 7.0  # 4.4 % of faults held, 150 s each
    instant = live_params(16384, P, replace(pool, refill_s=0.0))[1]
    assert ettr(16384, instant).ettr == pytest.approx(ettr(16384, replace(P, live_coverage=0.98)).ettr)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"spares": -1}, "spares must be >= 0, got -1"),
        ({"refill_s": -1.0}, "refill_s must be a finite number >= 0 or None, got -1.0"),
        ({"refill_s": math.nan}, "refill_s must be a finite number >= 0 or None, got nan"),
        ({"spare_wait_s": math.inf}, "spare_wait_s must be a finite number >= 0, got inf"),
        ({"job_days": 0.0}, "job_days must be a finite number > 0, got 0.0"),
        ({"uncoverable": 1.5}, "uncoverable must be in \\[0, 1\\], got 1.5"),
    ],
)
def test_bad_pool_parameters_say_what_was_seen(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpareParams(**changes)  # type: ignore[arg-type]


# --- the closed form against the simulation ---------------------------------------------------

#: (fault rate per s, pool): no refill (exact), the table's refills, and loads of 0.5 to 1
#: where holds time out and share deadlines.
CASES = [
    (1 / 86400, SpareParams(spares=2, refill_s=None, job_days=3.0)),
    (LAM_16K, SpareParams(spares=1, refill_s=None)),
    (LAM_16K, SpareParams(spares=1, refill_s=300.0)),
    (LAM_16K, SpareParams(spares=2, refill_s=11.0)),
    (1 / 1200, SpareParams(spares=1, refill_s=600.0, spare_wait_s=300.0)),
    (1 / 1200, SpareParams(spares=2, refill_s=600.0, spare_wait_s=300.0)),
    (1 / 1200, SpareParams(spares=3, refill_s=1200.0, spare_wait_s=300.0)),
]


@pytest.mark.parametrize(("lam", "pool"), CASES)
def test_simulation_stays_within_the_stated_bound_of_the_closed_form(lam: float, pool: SpareParams) -> None:
    """Coverage: from ``hold_error_bound`` below the closed form to 3 sigma above it (0 for
    no refill, where the closed form is exact); the blocking between B and B+, 3 sigma."""
    faults = 20000
    closed, sim = coverage(lam, pool), simulate_coverage(lam, pool, faults=faults, seed=1)

    def sigma(p: float) -> float:
        return math.sqrt(max(p * (1 - p), 1e-4) / faults)

    low = closed.coverage - hold_error_bound(lam, pool) - 3 * sigma(closed.coverage)
    assert low <= sim.coverage <= closed.coverage + 3 * sigma(closed.coverage)
    if pool.refill_s is not None:
        load = lam * pool.refill_s
        b_low, b_high = erlang_b(pool.spares, load), blocking_upper(pool.spares, load)
        assert b_low - 3 * sigma(b_low) <= sim.blocked <= b_high + 3 * sigma(b_high)
    assert sim.faults_per_job == pytest.approx(closed.faults_per_job, rel=0.1)


def test_simulated_wait_of_a_held_fault_is_a_third_of_the_refill_for_two_spares() -> None:
    """Deterministic T = W = 600 s: the earliest of two uniform residuals, T/3."""
    lam, pool = 1 / 3000, SpareParams(spares=2, refill_s=600.0, spare_wait_s=600.0)
    sim = simulate_coverage(lam, pool, faults=100_000, seed=2)
    assert sim.held_covered > 0.97
    assert sim.mean_wait_s == pytest.approx(coverage(lam, pool).mean_wait_s, rel=0.05)


@pytest.mark.parametrize("exponential", [False, True])
def test_with_no_wait_the_pool_is_erlangs_loss_system_whatever_the_refill_time(exponential: bool) -> None:
    """W = 0: a held fault gives its request back at once, as M/G/S/S drops it; the blocking
    is Erlang B for a fixed and for an exponential refill time (insensitivity)."""
    lam, pool = 1 / 1200, SpareParams(spares=2, refill_s=1200.0, spare_wait_s=0.0, uncoverable=0.0)
    sim = simulate_coverage(lam, pool, faults=100_000, seed=3, exponential=exponential)
    assert sim.blocked == pytest.approx(erlang_b(2, 1.0), abs=0.006)  # 0.2; 3 sigma is 0.004
    assert sim.coverage == pytest.approx(coverage(lam, pool).coverage, abs=0.006)


def test_when_every_held_fault_is_reached_the_blocking_is_the_upper_bound() -> None:
    """W >= T, nothing uncoverable, holds rarely shared: refills in flight are M/G/infinity."""
    lam, pool = 1 / 6000, SpareParams(spares=2, refill_s=3000.0, spare_wait_s=3000.0, uncoverable=0.0)
    sim = simulate_coverage(lam, pool, faults=100_000, seed=4)
    assert sim.blocked == pytest.approx(blocking_upper(2, 0.5), abs=0.003)  # 0.090; 3 sigma 0.0027
    assert sim.blocked > erlang_b(2, 0.5) + 0.008  # 0.077: the loss system is optimistic here


def test_one_request_at_a_time_agrees_at_the_tables_load() -> None:
    pool = SpareParams(spares=2, refill_s=300.0)
    parallel = simulate_coverage(LAM_16K, pool, faults=50_000, seed=5)
    serial = simulate_coverage(LAM_16K, pool, faults=50_000, seed=5, serial=True)
    assert serial.coverage == pytest.approx(parallel.coverage, abs=0.002)
    assert serial.blocked >= parallel.blocked


def test_simulation_without_faults_is_the_closed_form() -> None:
    pool = SpareParams()
    assert simulate_coverage(0.0, pool) == coverage(0.0, pool)


# --- tp goodput --spares ----------------------------------------------------------------------


def test_cli_spares_table_at_80_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    assert tp("goodput", "--gpus", "1024", "--gpus", "16384", "--spares", "1", "--refill-s", "300") == (
        0,
        """\
ETTR at 6.5 faults/1000 node-days; live migration: 2 s per fault
1 spare for a 14-day job, 2% of faults uncoverable; refill 300 s, wait 300 s
checkpoint restart: a checkpoint every 60 min (write 0 s), restart 300 s
                faults  restart  no-refill  no-refill  refill  refill  refill
  GPUs  nodes  per job     ETTR      cover       ETTR   cover   pause    ETTR
─────────────────────────────────────────────────────────────────────────────
 1,024    128     11.6    0.980      0.084      0.982   0.980     2.4   1.000
16,384  2,048    186.4    0.714      0.005      0.716   0.980     8.6   0.992
cover: share of faults resolved live; pause: mean s a covered fault costs
""",
        "",
    )


def test_cli_spares_table_with_the_simulation_is_wider_but_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    rule = "─" * 107
    assert tp("goodput", "--gpus", "16384", "--spares", "2", "--monte-carlo") == (
        0,
        f"""\
ETTR at 6.5 faults/1000 node-days; live migration: 2 s per fault
2 spares for a 14-day job, 2% of faults uncoverable; refill 11 s, wait 300 s
checkpoint restart: a checkpoint every 60 min (write 0 s), restart 300 s
                faults  restart  no-refill  no-refill  refill  refill  refill       MC   MC cover  MC cover
  GPUs  nodes  per job     ETTR      cover       ETTR   cover   pause    ETTR  restart  no-refill    refill
{rule}
16,384  2,048    186.4    0.714      0.011      0.717   0.980     2.0   0.993    0.711      0.010     0.981
cover: share of faults resolved live; pause: mean s a covered fault costs
MC: the simulation's ETTR and cover
""",
        "",
    )


def test_cli_spares_json_is_the_closed_form() -> None:
    out = tp(
        "goodput",
        "--gpus",
        "16384",
        "--spares",
        "2",
        "--refill-s",
        "30",
        "--spare-wait",
        "20",
        "--job-days",
        "7",
        "--uncoverable",
        "0.05",
        "--json",
    )
    assert (out.code, out.err) == (0, "")
    data = json.loads(out.out)
    pool = SpareParams(spares=2, refill_s=30.0, spare_wait_s=20.0, job_days=7.0, uncoverable=0.05)
    assert data["spares"] == {
        "spares": 2,
        "refill_s": 30.0,
        "spare_wait_s": 20.0,
        "job_days": 7.0,
        "uncoverable": 0.05,
    }
    (row,) = data["rows"]
    for key, p in (("refill", pool), ("no_refill", pool.no_refill())):
        cov, live = live_params(16384, P, p)
        entry = row["spares"][key]
        assert entry["coverage"] == pytest.approx(cov.coverage)
        assert entry["pause_s"] == pytest.approx(live.live_recovery_s)
        assert entry["ettr"] == pytest.approx(ettr(16384, live).ettr)
    assert row["live_migration"]["ettr"] == pytest.approx(ettr(16384, P).ettr)  # --live-coverage's


def test_cli_without_spares_has_no_spare_columns() -> None:
    data = json.loads(tp("goodput", "--gpus", "1024", "--json").out)
    assert "spares" not in data and "spares" not in data["rows"][0]


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--spares", "-1"], "Invalid value for '--spares': -1 is not in the range 0<=x<=1024."),
        (["--spares", "x"], "Invalid value for '--spares': 'x' is not a whole number (expected 0<=x<=1024)."),
        (
            ["--spares", "1.5"],
            "Invalid value for '--spares': '1.5' is not a whole number (expected 0<=x<=1024).",
        ),
        (
            ["--spares", "1", "--refill-s", "-3"],
            "Invalid value for '--refill-s': -3.0 is not in the range x>=0.",
        ),
        (
            ["--spares", "1", "--refill-s", "nan"],
            "Invalid value for '--refill-s': 'nan' is not a finite number (expected x>=0).",
        ),
        (
            ["--spares", "1", "--refill-s", "soon"],
            "Invalid value for '--refill-s': 'soon' is not a number (expected x>=0).",
        ),
        (
            ["--spares", "1", "--spare-wait", "inf"],
            "Invalid value for '--spare-wait': 'inf' is not a finite number (expected x>=0).",
        ),
        (
            ["--spares", "1", "--job-days", "0"],
            "Invalid value for '--job-days': 0.0 is not in the range 0<x<=3650.0.",
        ),
        (
            ["--spares", "1", "--uncoverable", "1.5"],
            "Invalid value for '--uncoverable': 1.5 is not in the range 0<=x<=1.",
        ),
        (
            ["--live-coverage", "nan"],
            "Invalid value for '--live-coverage': 'nan' is not a finite number (expected 0<=x<=1).",
        ),
        (["--gpus", "many"], "Invalid value for '--gpus': 'many' is not a whole number (expected x>=1)."),
        (
            ["--refill-s", "5"],
            "--refill-s describes the spare pool, which --spares turns on; "
            "give --spares S too (e.g. --spares 1)",
        ),
        (
            ["--job-days", "7", "--uncoverable", "0"],
            "--job-days, --uncoverable describe the spare pool, which --spares turns on; give --spares S too "
            "(e.g. --spares 1)",
        ),
    ],
)
def test_cli_refuses_hostile_input_with_a_usage_error(argv: list[str], error: str) -> None:
    out = tp("goodput", *argv)
    assert (out.code, out.out) == (2, "")
    assert out.err.splitlines()[-1] == f"Error: {error}"
