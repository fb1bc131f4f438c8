"""``tp goodput``: expected ETTR and lost GPU-hours per day, checkpoint restart
against live migration, for a few job sizes (the model: torchpass_slurm.analysis.goodput;
the plot: torchpass_slurm.analysis.goodput_plot)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import click

from torchpass_slurm.analysis.goodput import CLUSTER_FAILURES_PER_NODE_DAY, GoodputParams, ettr, simulate
from torchpass_slurm.cli.app import App, pass_app

_D = GoodputParams()
DEFAULT_GPUS = (1024, 16384, 131072)
Row = dict[str, object]


def rows(gpus: tuple[int, ...], params: GoodputParams, monte_carlo: bool, seed: int) -> list[Row]:
    """One row per job size: closed form (and simulation) for both recoveries."""
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
        out.append(row)
    return out


@click.command("goodput")
@click.option(
    "--gpus",
    type=click.IntRange(min=1),
    multiple=True,
    help="Job size in GPUs (repeatable). Default: 1024, 16384, 131072.",
)
@click.option(
    "--gpus-per-node",
    type=click.IntRange(min=1),
    default=_D.gpus_per_node,
    show_default=True,
    help="GPUs a node holds; a job of G GPUs holds ceil(G / this) nodes, and faults strike nodes.",
)
@click.option(
    "--cluster",
    type=click.Choice(sorted(CLUSTER_FAILURES_PER_NODE_DAY)),
    default="rsc1",
    show_default=True,
    help="Failure rate of one of the HPCA 2025 study's clusters: "
    "rsc1 6.50, rsc2 2.34 faults per 1000 node-days.",
)
@click.option(
    "--failure-rate", type=click.FloatRange(min=0), help="Faults per 1000 node-days; overrides --cluster."
)
@click.option(
    "--ckpt-interval",
    type=click.FloatRange(min=0, min_open=True),
    default=_D.ckpt_interval_s / 60,
    show_default=True,
    help="Minutes of training between checkpoints.",
)
@click.option(
    "--ckpt-write",
    type=click.FloatRange(min=0),
    default=_D.ckpt_write_s,
    show_default=True,
    help="Seconds training stops to write a checkpoint (0: asynchronous writes).",
)
@click.option(
    "--restart-overhead",
    type=click.FloatRange(min=0),
    default=_D.restart_overhead_s,
    show_default=True,
    help="Seconds to detect, requeue and restore after a fault (the study's u0).",
)
@click.option(
    "--live-recovery",
    type=click.FloatRange(min=0),
    default=_D.live_recovery_s,
    show_default=True,
    help="Seconds of job time a fault costs under live migration.",
)
@click.option(
    "--live-coverage",
    type=click.FloatRange(0, 1),
    default=_D.live_coverage,
    show_default=True,
    help="Share of faults live migration resolves; the rest fall back to checkpoint restart.",
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
    if plot_path is not None:
        _plot(params, plot_path)
    table = rows(gpus or DEFAULT_GPUS, params, monte_carlo, seed)
    if as_json:
        click.echo(json.dumps({"params": asdict(params), "rows": table}, indent=2))
        return
    _print_table(app, params, table, monte_carlo)


def _plot(params: GoodputParams, path: Path) -> None:
    """Write the plot first (a missing matplotlib fails before any output); progress on stderr."""
    from torchpass_slurm.analysis.goodput_plot import load_matplotlib, log_sizes, write_plot

    load_matplotlib()
    sizes = log_sizes()
    click.echo(f"plotting ETTR for {len(sizes)} job sizes, {sizes[0]:,} to {sizes[-1]:,} GPUs ...", err=True)
    write_plot(params, path, sizes)
    click.echo(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)", err=True)


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
    app.console.print(
        f"checkpoint restart: a checkpoint every {params.ckpt_interval_s / 60:g} min "
        f"(write {params.ckpt_write_s:g} s), restart {params.restart_overhead_s:g} s"
    )
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
