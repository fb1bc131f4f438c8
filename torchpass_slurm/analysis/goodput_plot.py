"""``tp goodput --plot``: expected ETTR and lost GPU-hours per day against job
size, checkpoint restart against live migration.

The numbers come from :mod:`torchpass_slurm.analysis.goodput`; this module only draws
them. matplotlib (the ``bench`` extra) is imported inside :func:`write_plot`,
through its object API and the Agg canvas: no pyplot, no global backend, and
``tp --help`` never loads it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from torchpass_slurm.analysis.goodput import GoodputParams, ettr
from torchpass_slurm.errors import TorchpassError

#: The study's checkpoint-restart examples: (GPUs, checkpoint interval in s, published ETTR).
PUBLISHED = ((16384, 3600.0, 0.70), (16384, 300.0, 0.93))

#: Job sizes marked on the plot: the rows of ``tp goodput``'s table.
MARKED_GPUS = (1024, 16384, 131072)

#: The short checkpoint interval drawn next to the chosen one (the study's second example).
SHORT_INTERVAL_S = 300.0

INSTALL_HINT = "pip install 'torchpass-slurm[bench]'"


def log_sizes(lo: int = 512, hi: int = 131072, points: int = 30) -> list[int]:
    """``points`` job sizes from ``lo`` to ``hi`` GPUs, evenly spaced on a log scale."""
    if not 1 <= lo < hi or points < 2:
        raise ValueError(f"need 1 <= lo < hi and points >= 2, got lo={lo}, hi={hi}, points={points}")
    return sorted({round(lo * (hi / lo) ** (i / (points - 1))) for i in range(points)})


@dataclass(frozen=True)
class Curve:
    """One line of the plot: a recovery and its parameters."""

    label: str
    params: GoodputParams
    color: str


def curves(params: GoodputParams) -> list[Curve]:
    """Checkpoint restart at the chosen interval and at 5 minutes, then live migration."""
    cr = params.checkpoint_restart()
    every = _minutes(params.ckpt_interval_s)
    out = [Curve(f"checkpoint restart, every {every}", cr, "tab:red")]
    if params.ckpt_interval_s != SHORT_INTERVAL_S:
        out.append(
            Curve(
                f"checkpoint restart, every {_minutes(SHORT_INTERVAL_S)}",
                replace(cr, ckpt_interval_s=SHORT_INTERVAL_S),
                "tab:orange",
            )
        )
    out.append(
        Curve(
            f"live migration: {params.live_recovery_s:g} s pause for "
            f"{params.live_coverage:.0%} of faults (the rest: restart, every {every})",
            params,
            "tab:blue",
        )
    )
    return out


def write_plot(params: GoodputParams, path: Path, sizes: list[int] | None = None) -> Path:
    """Draw ETTR (left) and lost GPU-hours per day (right) against job size into ``path`` (PNG)."""
    figure_cls, canvas_cls = load_matplotlib()
    sizes = sizes or log_sizes()
    fig = figure_cls(figsize=(12.5, 5.2), dpi=110, layout="constrained")
    canvas_cls(fig)
    left, right = fig.subplots(1, 2)
    for curve in curves(params):
        points = [ettr(n, curve.params) for n in sizes]
        lost = [max(g.lost_gpu_hours_per_day, 1e-3) for g in points]  # > 0 for the log axis
        left.plot(sizes, [g.ettr for g in points], color=curve.color, label=curve.label, lw=2)
        right.plot(sizes, lost, color=curve.color, lw=2)
    for i, (gpus, interval_s, value) in enumerate(PUBLISHED):
        left.plot([gpus], [value], "kX", ms=9, zorder=5, label=None if i else "the study's examples (RSC-1)")
        left.annotate(
            f"the study: {value:.2f}, every {_minutes(interval_s)}",
            (gpus, value),
            xytext=(0.08, value - 0.12),
            textcoords=("axes fraction", "data"),
            fontsize=8,
            arrowprops={"arrowstyle": "->", "color": "dimgrey", "lw": 0.8},
        )
    for ax in (left, right):
        _size_axis(ax, sizes)
    left.set(ylim=(0.0, 1.02), ylabel="expected ETTR (productive time / wall time)")
    right.set(yscale="log", ylabel="lost GPU-hours per day")
    left.set_title("Expected effective training time ratio", fontsize=10)
    right.set_title("GPU-hours lost to faults and checkpoints, per day", fontsize=10)
    right.legend(*left.get_legend_handles_labels(), loc="lower right", fontsize=8)
    fig.suptitle(_title(params), fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(path, format="png")
    except OSError as err:
        raise TorchpassError(f"could not write the plot to {path}: {err}") from err
    return path


def load_matplotlib() -> tuple[Any, Any]:
    """matplotlib's ``Figure`` and Agg canvas, or an error that says what to install."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise TorchpassError(
            f"--plot needs matplotlib, which could not be imported ({err})", hint=INSTALL_HINT
        ) from err
    return Figure, FigureCanvasAgg


def _size_axis(ax: Any, sizes: list[int]) -> None:
    """Log-2 GPU axis with ticks at the powers of two; the table's sizes marked on top."""
    ax.set_xscale("log", base=2)
    ax.set_xlim(sizes[0], sizes[-1])
    ticks = [
        2**k
        for k in range(sizes[0].bit_length() - 1, sizes[-1].bit_length())
        if sizes[0] <= 2**k <= sizes[-1]
    ]
    ax.set_xticks(ticks, [f"{t // 1024}k" if t >= 1024 else str(t) for t in ticks])
    ax.set_xlabel("job size, GPUs (log scale; 1k = 1,024)")
    ax.grid(True, which="major", alpha=0.3)
    marked = [gpus for gpus in MARKED_GPUS if sizes[0] <= gpus <= sizes[-1]]
    for gpus in marked:
        ax.axvline(gpus, color="grey", ls=":", lw=1)
    top = ax.secondary_xaxis("top")
    top.set_xticks(marked, [f"{gpus:,}" for gpus in marked], fontsize=8, color="dimgrey")
    top.minorticks_off()


def _title(p: GoodputParams) -> str:
    return (
        f"{p.failure_rate_per_node_day * 1000:g} faults per 1000 node-days "
        f"({p.gpus_per_node} GPUs a node), restart overhead {p.restart_overhead_s / 60:g} min, "
        f"checkpoint write {p.ckpt_write_s:g} s; "
        f"live migration: {p.live_recovery_s:g} s pause, "
        f"covers {p.live_coverage:.0%} of faults"
    )


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:g} min"
