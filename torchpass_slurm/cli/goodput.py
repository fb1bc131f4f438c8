"""``tp goodput``: expected ETTR and lost GPU-hours per day, checkpoint restart
against live migration, for a few job sizes (the model: torchpass_slurm.analysis.goodput;
coverage from spares: torchpass_slurm.analysis.coverage; the plot:
torchpass_slurm.analysis.goodput_plot)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click

from torchpass_slurm.analysis.coverage import SpareParams, live_params, simulate_coverage
from torchpass_slurm.analysis.goodput import CLUSTER_FAILURES_PER_NODE_DAY, GoodputParams, ettr, simulate
from torchpass_slurm.cli.app import App, pass_app

_D = GoodputParams()
_S = SpareParams()
DEFAULT_GPUS = (1024, 16384, 131072)
Row = dict[str, object]

#: The options that describe the spare pool, by parameter name: each needs --spares.
POOL_OPTIONS = {
    "refill_s": "--refill-s",
    "spare_wait": "--spare-wait",
    "job_days": "--job-days",
    "uncoverable": "--uncoverable",
}
#: Bounds of --spares and --job-days (the no-refill sum costs S^2 steps).
MAX_SPARES = 1024
MAX_JOB_DAYS = 3650.0


class Finite(click.FloatRange):
    """A float range that says "not a number" plainly and refuses NaN and the infinities
    (which click's ranges let through)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not _parses(float, value):
            self.fail(f"{value!r} is not a number (expected {self._describe_range()}).", param, ctx)
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number (expected {self._describe_range()}).", param, ctx)
        return number


class Count(click.IntRange):
    """An integer range that says "not a whole number" plainly."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not _parses(int, value):
            self.fail(f"{value!r} is not a whole number (expected {self._describe_range()}).", param, ctx)
        return super().convert(value, param, ctx)


def _parses(kind: type, text: str) -> bool:
    try:
        kind(text.strip())
    except ValueError:
        return False
    return True


def _setting(
    name: str, kind: click.ParamType[Any], default: Any, help: str, metavar: str | None = None
) -> Any:
    """A model parameter: an option with a type, a default shown in --help, and its meaning."""
    return click.option(name, type=kind, default=default, show_default=True, metavar=metavar, help=help)


def rows(
    gpus: tuple[int, ...],
    params: GoodputParams,
    monte_carlo: bool,
    seed: int,
    pool: SpareParams | None = None,
) -> list[Row]:
    """One row per job size: closed form (and simulation) for both recoveries, and with a
    ``pool``, live migration's coverage from it without and with refill."""
    out: list[Row] = []
    for n in gpus:
        row: Row = {}
        for key, p in (("checkpoint_restart", params.checkpoint_restart()), ("live_migration", params)):
            closed = ettr(n, p)
            row.update(gpus=n, nodes=closed.nodes, faults_per_day=closed.faults_per_day)
            entry = {"ettr": closed.ettr, "lost_gpu_hours_per_day": closed.lost_gpu_hours_per_day}
            if monte_carlo:
                sim = simulate(n, p, seed=seed)
                entry.update(mc_ettr=sim.ettr, mc_lost_gpu_hours_per_day=sim.lost_gpu_hours_per_day)
            row[key] = entry
        if pool is not None:
            row["spares"] = {
                "no_refill": spare_entry(n, params, pool.no_refill(), monte_carlo, seed),
                "refill": spare_entry(n, params, pool, monte_carlo, seed),
            }
        out.append(row)
    return out


def spare_entry(gpus: int, params: GoodputParams, pool: SpareParams, monte_carlo: bool, seed: int) -> Row:
    """Coverage from ``pool`` for a job of ``gpus`` GPUs, the pause and the ETTR it implies."""
    cov, live = live_params(gpus, params, pool)
    closed = ettr(gpus, live)
    entry: Row = {
        **asdict(cov),
        "pause_s": live.live_recovery_s,
        "ettr": closed.ettr,
        "lost_gpu_hours_per_day": closed.lost_gpu_hours_per_day,
    }
    if monte_carlo:
        sim = simulate_coverage(params.fault_rate_per_s(gpus), pool, seed=seed)
        entry.update(mc_coverage=sim.coverage, mc_blocked=sim.blocked)
    return entry


@click.command("goodput")
@click.option(
    "--gpus",
    type=Count(min=1),
    multiple=True,
    help="Job size in GPUs (repeatable). Default: 1024, 16384, 131072.",
)
@_setting(
    "--gpus-per-node",
    Count(min=1),
    _D.gpus_per_node,
    "GPUs a node holds; a job of G GPUs holds ceil(G / this) nodes, and faults strike nodes.",
)
@_setting(
    "--cluster",
    click.Choice(sorted(CLUSTER_FAILURES_PER_NODE_DAY)),
    "rsc1",
    "Failure rate of one of the HPCA 2025 study's clusters: rsc1 6.50, rsc2 2.34 faults per 1000 node-days.",
)
@click.option("--failure-rate", type=Finite(min=0), help="Faults per 1000 node-days; overrides --cluster.")
@_setting(
    "--ckpt-interval",
    Finite(min=0, min_open=True),
    _D.ckpt_interval_s / 60,
    "Minutes of training between checkpoints.",
)
@_setting(
    "--ckpt-write",
    Finite(min=0),
    _D.ckpt_write_s,
    "Seconds training stops to write a checkpoint (0: asynchronous writes).",
)
@_setting(
    "--restart-overhead",
    Finite(min=0),
    _D.restart_overhead_s,
    "Seconds to detect, requeue and restore after a fault (the study's u0).",
)
@_setting(
    "--live-recovery",
    Finite(min=0),
    _D.live_recovery_s,
    "Seconds of job time a fault costs under live migration.",
)
@_setting(
    "--live-coverage",
    Finite(0, 1),
    _D.live_coverage,
    "Share of faults live migration resolves; the rest fall back to checkpoint restart.",
)
@click.option(
    "--spares",
    type=Count(0, MAX_SPARES),
    metavar="S",
    help="Spares the job reserves. Given, live migration's coverage comes from them instead of "
    "--live-coverage, shown without and with refill (docs/goodput.md, 'Coverage from spares').",
)
@_setting(
    "--refill-s",
    Finite(min=0),
    _S.refill_s,
    "Seconds from asking Slurm for a replacement node to a ready spare "
    "(2 to 11 s measured with an idle node). Needs --spares.",
    metavar="SECONDS",
)
@_setting(
    "--spare-wait",
    Finite(min=0),
    _S.spare_wait_s,
    "Seconds the survivors hold the committed step for a refill when no spare is ready "
    "(tp-submit --spare-wait); a node within it keeps the move live. Needs --spares.",
    metavar="SECONDS",
)
@_setting(
    "--job-days",
    Finite(0, MAX_JOB_DAYS, min_open=True),
    _S.job_days,
    "Days of wall time the job lives: without refill, its spares cover only its first S faults. "
    "Needs --spares.",
    metavar="DAYS",
)
@_setting(
    "--uncoverable",
    Finite(0, 1),
    _S.uncoverable,
    "Share of faults no spare can cover whatever the pool (every copy of a shard lost). Needs --spares.",
    metavar="SHARE",
)
@click.option(
    "--monte-carlo", is_flag=True, help="Also simulate (20,000 faults per cell) to check the closed form."
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the simulation.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    metavar="FILE.png",
    help="Also draw ETTR and lost GPU-hours against job size (512 to 131,072 GPUs) "
    "into a PNG; needs matplotlib (pip install 'torchpass-slurm[bench]').",
)
@pass_app
def goodput(
    app: App,
    gpus: tuple[int, ...],
    gpus_per_node: int,
    cluster: str,
    failure_rate: float | None,
    ckpt_interval: float,
    ckpt_write: float,
    restart_overhead: float,
    live_recovery: float,
    live_coverage: float,
    spares: int | None,
    refill_s: float,
    spare_wait: float,
    job_days: float,
    uncoverable: float,
    monte_carlo: bool,
    seed: int,
    as_json: bool,
    plot_path: Path | None,
) -> None:
    """Expected effective training time ratio (ETTR) and lost GPU-hours per day
    of a training job, checkpoint restart against live migration.

    Faults strike each node as a Poisson process; the table gives the exact
    closed form for each job size (--monte-carlo adds a simulation of the same
    process). The defaults are the study's: Meta's RSC-1 failure rate, a
    5-minute restart, hourly checkpoints written asynchronously. The model and
    its sources: docs/goodput.md.

    With --spares, live migration covers what the job's spares allow: without
    refill only its first S faults, with refill every fault that finds a spare
    or gets one within --spare-wait (less the --uncoverable share).
    """
    rate = CLUSTER_FAILURES_PER_NODE_DAY[cluster] if failure_rate is None else failure_rate / 1000
    params = GoodputParams(
        gpus_per_node=gpus_per_node,
        failure_rate_per_node_day=rate,
        ckpt_interval_s=ckpt_interval * 60,
        ckpt_write_s=ckpt_write,
        restart_overhead_s=restart_overhead,
        live_recovery_s=live_recovery,
        live_coverage=live_coverage,
    )
    pool = _pool(spares, refill_s, spare_wait, job_days, uncoverable)
    if plot_path is not None:
        _plot(params, plot_path)
    table = rows(gpus or DEFAULT_GPUS, params, monte_carlo, seed, pool)
    if as_json:
        head: Row = {"params": asdict(params), **({"spares": asdict(pool)} if pool is not None else {})}
        click.echo(json.dumps({**head, "rows": table}, indent=2))
        return
    if pool is None:
        _print_table(app, params, table, monte_carlo)
    else:
        _print_spare_table(app, params, pool, table, monte_carlo)


def _pool(
    spares: int | None, refill_s: float, spare_wait: float, job_days: float, uncoverable: float
) -> SpareParams | None:
    """The spare pool of --spares and its options; an option of the pool without --spares is an error."""
    ctx = click.get_current_context()
    given = [
        option
        for name, option in POOL_OPTIONS.items()
        if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT
    ]
    if spares is None:
        if given:
            raise click.UsageError(
                f"{', '.join(given)} describe{'s' if len(given) == 1 else ''} the spare pool, "
                "which --spares turns on; give --spares S too (e.g. --spares 1)"
            )
        return None
    return SpareParams(spares, refill_s, spare_wait, job_days, uncoverable)


def _plot(params: GoodputParams, path: Path) -> None:
    """Write the plot first (a missing matplotlib fails before any output); progress on stderr."""
    from torchpass_slurm.analysis.goodput_plot import load_matplotlib, log_sizes, write_plot

    load_matplotlib()
    sizes = log_sizes()
    click.echo(f"plotting ETTR for {len(sizes)} job sizes, {sizes[0]:,} to {sizes[-1]:,} GPUs ...", err=True)
    write_plot(params, path, sizes)
    click.echo(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)", err=True)


def _restart_line(params: GoodputParams) -> str:
    return (
        f"checkpoint restart: a checkpoint every {params.ckpt_interval_s / 60:g} min "
        f"(write {params.ckpt_write_s:g} s), restart {params.restart_overhead_s:g} s"
    )


#: The table's columns: header (lines apart), then the same with --monte-carlo.
COLUMNS = (
    "GPUs",
    "nodes",
    "faults\nper day",
    "restart\nETTR",
    "restart\nGPU-h/d",
    "live\nETTR",
    "live\nGPU-h/d",
)
MONTE_CARLO_COLUMNS = ("MC\nrestart", "MC\nlive")


def _print_table(app: App, params: GoodputParams, table: list[Row], monte_carlo: bool) -> None:
    """The parameters, a borderless table, what its abbreviations mean: 80 columns, MC included."""
    from rich import box
    from rich.table import Table

    from torchpass_slurm.cli.report import print_wide

    app.console.print(
        f"ETTR at {params.failure_rate_per_node_day * 1000:g} faults/1000 node-days; "
        f"live migration: {params.live_recovery_s:g} s per fault, covers {params.live_coverage:.0%}"
    )
    app.console.print(_restart_line(params))
    t = Table(box=box.SIMPLE, show_edge=False, pad_edge=False, collapse_padding=True)
    for name in COLUMNS + (MONTE_CARLO_COLUMNS if monte_carlo else ()):
        t.add_column(name, justify="right", no_wrap=True)
    for row in table:
        cr, lm = row["checkpoint_restart"], row["live_migration"]
        assert isinstance(cr, dict) and isinstance(lm, dict)
        cells = [
            f"{row['gpus']:,}",
            f"{row['nodes']:,}",
            f"{row['faults_per_day']:.2f}",
            f"{cr['ettr']:.3f}",
            f"{cr['lost_gpu_hours_per_day']:,.0f}",
            f"{lm['ettr']:.3f}",
            f"{lm['lost_gpu_hours_per_day']:,.0f}",
        ]
        if monte_carlo:
            cells += [f"{cr['mc_ettr']:.3f}", f"{lm['mc_ettr']:.3f}"]
        t.add_row(*cells)
    print_wide(app.console, t)
    app.console.print(
        "GPU-h/d: GPU-hours lost per day" + ("; MC: the simulation's ETTR" if monte_carlo else "")
    )


#: The table's columns with --spares, then the same with --monte-carlo.
SPARE_COLUMNS = (
    "GPUs",
    "nodes",
    "faults\nper job",
    "restart\nETTR",
    "no-refill\ncover",
    "no-refill\nETTR",
    "refill\ncover",
    "refill\npause",
    "refill\nETTR",
)
SPARE_MONTE_CARLO_COLUMNS = ("MC\nrestart", "MC cover\nno-refill", "MC cover\nrefill")


def _print_spare_table(
    app: App, params: GoodputParams, pool: SpareParams, table: list[Row], monte_carlo: bool
) -> None:
    """The parameters, a borderless table with the coverage of ``pool``, what its words mean."""
    from rich import box
    from rich.table import Table

    from torchpass_slurm.cli.report import print_wide

    spares = f"{pool.spares} spare{'' if pool.spares == 1 else 's'}"
    app.console.print(
        f"ETTR at {params.failure_rate_per_node_day * 1000:g} faults/1000 node-days; "
        f"live migration: {params.live_recovery_s:g} s per fault"
    )
    app.console.print(
        f"{spares} for a {pool.job_days:g}-day job, {pool.uncoverable * 100:g}% of faults uncoverable; "
        f"refill {pool.refill_s:g} s, wait {pool.spare_wait_s:g} s"
    )
    app.console.print(_restart_line(params))
    t = Table(box=box.SIMPLE, show_edge=False, pad_edge=False, collapse_padding=True)
    for name in SPARE_COLUMNS + (SPARE_MONTE_CARLO_COLUMNS if monte_carlo else ()):
        t.add_column(name, justify="right", no_wrap=True)
    for row in table:
        cr, pools = row["checkpoint_restart"], row["spares"]
        assert isinstance(cr, dict) and isinstance(pools, dict)
        static, refill = pools["no_refill"], pools["refill"]
        cells = [
            f"{row['gpus']:,}",
            f"{row['nodes']:,}",
            f"{static['faults_per_job']:,.1f}",
            f"{cr['ettr']:.3f}",
            f"{static['coverage']:.3f}",
            f"{static['ettr']:.3f}",
            f"{refill['coverage']:.3f}",
            f"{refill['pause_s']:.1f}",
            f"{refill['ettr']:.3f}",
        ]
        if monte_carlo:
            cells += [f"{cr['mc_ettr']:.3f}", f"{static['mc_coverage']:.3f}", f"{refill['mc_coverage']:.3f}"]
        t.add_row(*cells)
    print_wide(app.console, t)
    app.console.print("cover: share of faults resolved live; pause: mean s a covered fault costs")
    if monte_carlo:
        app.console.print("MC: the simulation's ETTR and cover")
