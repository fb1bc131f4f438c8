"""The goodput model: the study's examples, the closed form against the
simulation, the CLI and its plot."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.unit.cli.conftest import tp
from torchpass_slurm.analysis.goodput import GoodputParams, ettr, ettr_first_order, simulate
from torchpass_slurm.analysis.goodput_plot import log_sizes

CR = GoodputParams().checkpoint_restart()


def test_defaults_are_the_studys_parameters() -> None:
    """RSC-1's 6.50 faults per 1000 node-days, u0 = 5 min, hourly checkpoints,
    writes off the critical path; the MTTFs the study projects from that rate."""
    p = GoodputParams()
    assert p.failure_rate_per_node_day == 6.50e-3
    assert (p.restart_overhead_s, p.ckpt_interval_s, p.ckpt_write_s) == (300.0, 3600.0, 0.0)
    mttf_h = {gpus: 1 / p.fault_rate_per_s(gpus) / 3600 for gpus in (16384, 131072)}
    assert mttf_h[16384] == pytest.approx(1.8, abs=0.01)
    assert mttf_h[131072] == pytest.approx(0.23, abs=0.005)


@pytest.mark.parametrize(("interval_s", "published"), [(3600.0, 0.70), (300.0, 0.93)])
def test_reproduces_the_studys_16384_gpu_examples(interval_s: float, published: float) -> None:
    p = replace(CR, ckpt_interval_s=interval_s)
    assert ettr(16384, p).ettr == pytest.approx(published, abs=0.03)
    assert ettr_first_order(16384, p) == pytest.approx(published, abs=0.03)


def test_first_order_rule_is_the_studys_estimator_when_writes_are_free() -> None:
    """E[ETTR] ~ (1 - N r_f (u0 + dt_cp/2)) / (1 + w_cp/dt_cp) with w_cp = 0."""
    p = replace(CR, ckpt_interval_s=1800.0)
    lam = p.fault_rate_per_s(16384)
    assert ettr_first_order(16384, p) == pytest.approx(1 - lam * (300.0 + 1800.0 / 2))


@pytest.mark.parametrize(
    ("gpus", "params"),
    [
        (16384, CR),
        (1024, replace(CR, ckpt_interval_s=600.0, ckpt_write_s=60.0)),
        (16384, GoodputParams()),
        (131072, replace(GoodputParams(), live_coverage=0.5, ckpt_interval_s=900.0, ckpt_write_s=30.0)),
    ],
)
def test_monte_carlo_agrees_with_the_closed_form_within_2_percent(gpus: int, params: GoodputParams) -> None:
    closed = ettr(gpus, params).ettr
    assert simulate(gpus, params, seed=1).ettr == pytest.approx(closed, rel=0.02)


def test_full_coverage_costs_only_the_recovery_and_the_writes() -> None:
    p = GoodputParams(live_coverage=1.0, ckpt_write_s=36.0, live_recovery_s=30.0)
    lam = p.fault_rate_per_s(16384)
    assert ettr(16384, p).ettr == pytest.approx(3600 / 3636 * math.exp(-lam * 30.0))


def test_no_faults_leaves_only_the_checkpoint_writes() -> None:
    p = GoodputParams(failure_rate_per_node_day=0.0, ckpt_write_s=36.0)
    assert ettr(1024, p).ettr == pytest.approx(3600 / 3636)
    assert simulate(1024, p).ettr == pytest.approx(3600 / 3636)


def test_lost_gpu_hours_are_the_lost_share_of_the_job() -> None:
    g = ettr(1024, CR)
    assert g.lost_gpu_hours_per_day == pytest.approx((1 - g.ettr) * 1024 * 24)
    assert g.nodes == 128 and g.faults_per_day == pytest.approx(128 * 6.5e-3)


def test_bad_parameters_say_what_was_seen() -> None:
    with pytest.raises(ValueError, match=r"live_coverage must be in \[0, 1\], got 1\.5"):
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


def test_cli_table_fits_80_columns_without_cutting_a_header(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    rule = "─" * 78  # a coverage below 1 gives the live columns their widest numbers
    assert tp("goodput", "--monte-carlo", "--live-coverage", "0.78") == (
        0,
        f"""\
ETTR at 6.5 faults/1000 node-days; live migration: 2 s per fault, covers 78%
checkpoint restart: a checkpoint every 60 min (write 0 s), restart 300 s
                  faults  restart    restart   live       live       MC     MC
   GPUs   nodes  per day     ETTR    GPU-h/d   ETTR    GPU-h/d  restart   live
{rule}
  1,024     128     0.83    0.980        493  0.996        110    0.980  0.996
 16,384   2,048    13.31    0.714    112,311  0.930     27,405    0.711  0.929
131,072  16,384   106.50    0.037  3,030,301  0.536  1,460,929    0.034  0.530
GPU-h/d: GPU-hours lost per day; MC: the simulation's ETTR
""",
        "",
    )
    plain = tp("goodput", "--live-coverage", "0.78").out.splitlines()
    assert plain[2:4] == [
        "                  faults  restart    restart   live       live",
        "   GPUs   nodes  per day     ETTR    GPU-h/d   ETTR    GPU-h/d",
    ]
    assert plain[-1] == "GPU-h/d: GPU-hours lost per day"


def test_cli_rejects_a_coverage_above_one() -> None:
    out = tp("goodput", "--live-coverage", "2")
    assert out.code == 2
    assert "--live-coverage" in out.err


def test_cli_cluster_preset_and_explicit_rate() -> None:
    rsc2 = json.loads(tp("goodput", "--gpus", "1024", "--cluster", "rsc2", "--json").out)
    assert rsc2["params"]["failure_rate_per_node_day"] == pytest.approx(2.34e-3)
    both = json.loads(
        tp("goodput", "--gpus", "1024", "--cluster", "rsc2", "--failure-rate", "1", "--json").out
    )
    assert both["params"]["failure_rate_per_node_day"] == pytest.approx(1e-3)


def test_log_sizes_span_512_to_131072_gpus() -> None:
    sizes = log_sizes()
    assert (len(sizes), sizes[0], sizes[-1]) == (30, 512, 131072)
    assert sizes == sorted(set(sizes))


def test_cli_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "img" / "goodput.png"
    out = tp("goodput", "--gpus", "16384", "--plot", str(path))
    assert out.code == 0, out.err
    assert out.err == (
        f"plotting ETTR for 30 job sizes, 512 to 131,072 GPUs ...\n"
        f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)\n"
    )
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert 30_000 < len(data) < 1_000_000
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert width > 1000 and height > 400
    assert "16,384" in out.out


def test_cli_plot_without_matplotlib_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # None makes the import raise ImportError
    out = tp("goodput", "--plot", str(tmp_path / "goodput.png"))
    assert (out.code, out.out) == (1, "")
    message, hint = out.err.splitlines()
    assert message.startswith(
        "error: --plot needs matplotlib, which could not be imported (import of matplotlib"
    )
    assert hint == "  hint: pip install 'torchpass-slurm[bench]'"
    assert not (tmp_path / "goodput.png").exists()


def test_help_does_not_import_matplotlib_or_torch() -> None:
    code = (
        "import sys\n"
        "from torchpass_slurm.cli.app import run_cli\n"
        "from torchpass_slurm.cli.main import cli\n"
        "for argv in (['--help'], ['goodput', '--help']):\n"
        "    assert run_cli(cli, argv, prog_name='tp') == 0\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'torch')]\n"
        "print(sorted(loaded), file=sys.stderr)"
    )
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr
    assert err == "[]\n"
