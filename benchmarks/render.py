"""The suite's results as markdown tables and PNG plots.

Pure up to the last step: :func:`tables` turns the results dict (what
``benchmarks/suite.py`` writes to JSON) into markdown, :func:`update_doc`
replaces the generated part of docs/benchmarks.md (between the two markers),
and :func:`write_plots` draws the figures with matplotlib's object API on the
Agg canvas (imported only there). ``python3 -m benchmarks.render RESULTS.json``
redraws everything from a saved run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks import detection
from benchmarks.runs import UNPLANNED_BY_TRANSPORT, UNPLANNED_SHORT

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
IMG_DIR = ROOT / "docs" / "img"
BEGIN = "<!-- suite:begin (written by benchmarks/suite.py; edit around it, not in it) -->"
END = "<!-- suite:end -->"

PHASES = ("detection", "decision", "rebuild", "agreement", "transfer", "first_step")
PHASE_LABELS = ("detection", "decision", "group rebuild", "agreement", "transfer", "first step")
FAULT_KINDS = ("unplanned", UNPLANNED_SHORT, *UNPLANNED_BY_TRANSPORT, "pre-emptive", "planned")
COMPLETION_RUNS = (
    ("no_fault", "no fault"),
    ("live", "live migration (tp run)"),
    ("restart", "checkpoint restart in the allocation (tp run)"),
    ("requeue", "sbatch --requeue + periodic checkpoints (plain DDP)"),
)
SHORT_LABELS = {
    "no_fault": "no fault",
    "live": "live migration",
    "restart": "checkpoint restart\n(in the allocation)",
    "requeue": "sbatch --requeue\n(plain DDP)",
}
TRANSFER_METHODS = (
    ("raw-tcp", "raw TCP (baseline)"),
    ("socket+stream", "socket + stream"),
    ("gloo-raw", "gloo send/recv"),
    ("torch+stream", "torch (gloo) + stream: live migration (auto)"),
    ("mpi-raw", "MPICH send/recv, in the rank"),
    ("mpi+stream", "MPICH + stream, in the rank"),
    ("mpi-helper+stream", "MPICH + stream in a helper process: live migration (mpi)"),
)


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


# --- tables ------------------------------------------------------------------------------


def overhead_table(r: Mapping[str, Any]) -> list[str]:
    runs, median = r["runs"], r["median_tokens_per_s"]
    rows = [
        [
            f"run {i + 1}",
            _num(p["tokens_per_s"], 0),
            _num(t["tokens_per_s"], 0),
            f"{100 * (1 - t['tokens_per_s'] / p['tokens_per_s']):+.1f} %",
            _share(t.get("supervisor_core_percent")),
            _share(t.get("srun_core_percent")),
        ]
        for i, (p, t) in enumerate(zip(runs["plain"], runs["tp"], strict=False))
    ]
    rows.append(
        [
            "**median**",
            f"**{median['plain']:.0f}**",
            f"**{median['tp']:.0f}**",
            f"**{r['overhead_percent']:+.1f} %**",
            _share(r.get("median_supervisor_core_percent")),
            "",
        ]
    )
    same = "the same" if r["same_final_loss"] else "NOT the same"
    bitwise = ", ".join(
        f"{name}: {'yes' if ok else 'no'}" for name, ok in r["bitwise_equal_within_mode"].items()
    )
    header = (
        "run",
        "plain srun + DDP (tokens/s)",
        "tp run, 1 hot spare (tokens/s)",
        "throughput lost under tp run",
        "tp run's supervisor (% of a core)",
        "its srun steps (% of a core)",
    )
    return [
        *_table(header, rows),
        "",
        f"Final loss {same} in every run, plain and tp; bitwise equal final weights "
        f"across the runs of a mode: {bitwise}.",
    ]


def _share(percent: float | None) -> str:
    return "-" if percent is None else f"{percent:.2f} %"


def job_seconds(run: Mapping[str, Any]) -> float:
    """From the job's first start to its end: the queue wait before it is not the method's."""
    started = next((t for t, state in run.get("timeline", []) if state == "RUNNING"), 0.0)
    return float(run["seconds"]) - started


def _first_fault(run: Mapping[str, Any]) -> Mapping[str, Any]:
    faults = run.get("faults") or []
    return faults[0] if faults else {}


def recovery_table(r: Mapping[str, Any]) -> list[str]:
    base = job_seconds(r["no_fault"])
    rows = [["no fault", _num(base, 1), "-", "-", *["-"] * (len(PHASES) + 1), "-", "-"]]
    for kind in FAULT_KINDS:
        run = r.get(kind)
        if not run:
            continue
        f = _first_fault(run)
        phases = f.get("phases", {})
        rows.append(
            [
                kind,
                _num(job_seconds(run), 1),
                f"{job_seconds(run) - base:+.1f}",
                str(f.get("resolution") or "-"),
                *[_num(phases.get(p)) for p in PHASES],
                _num(phases.get("total")),
                _steps(f.get("lost_steps")),
                _steps(f.get("recomputed_steps")),
            ]
        )
    return _table(
        (
            "fault",
            "job time (s)",
            "over no fault (s)",
            "resolution",
            *PHASE_LABELS,
            "total",
            "steps lost",
            "recomputed",
        ),
        rows,
    )


def _steps(value: int | None) -> str:
    return "?" if value is None else str(value)


def completion_rows(r: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per run: job time, its excess over the fault-free run, steps lost and recomputed."""
    base = job_seconds(r["no_fault"])
    out = []
    for key, label in COMPLETION_RUNS:
        run = r.get(key)
        if not run:
            continue
        if key == "requeue":
            lost = recomputed = run["recomputed_steps"]
        else:
            faults = run.get("faults") or []
            lost = _sum_known(f.get("lost_steps") for f in faults)
            recomputed = _sum_known(f.get("recomputed_steps") for f in faults)
        out.append(
            {
                "key": key,
                "label": label,
                "seconds": job_seconds(run),
                "excess": job_seconds(run) - base,
                "faults": len(run.get("injected", [])),
                "lost": lost,
                "recomputed": recomputed,
                "state": run["state"],
                "resolutions": sorted({str(f.get("resolution")) for f in run.get("faults") or []}),
            }
        )
    return out


def _sum_known(values: Any) -> int | None:
    values = list(values)
    return None if not values or any(v is None for v in values) else sum(values)


def completion_table(r: Mapping[str, Any]) -> list[str]:
    rows = [
        [
            row["label"],
            str(row["faults"]),
            row["state"],
            _num(row["seconds"], 1),
            "-" if row["key"] == "no_fault" else f"{row['excess']:+.1f}",
            _steps(row["lost"]) if row["key"] != "no_fault" else "-",
            _steps(row["recomputed"]) if row["key"] != "no_fault" else "-",
        ]
        for row in completion_rows(r)
    ]
    lines = _table(
        (
            "run",
            "nodes killed",
            "end",
            "job time (s)",
            "over no fault (s)",
            "committed steps lost",
            "steps computed again",
        ),
        rows,
    )
    requeue = r.get("requeue")
    if requeue:
        lines += [
            "",
            f"The requeued job started {len(requeue['starts_at_steps'])} times, at steps "
            f"{', '.join(map(str, requeue['starts_at_steps']))} (its newest checkpoints).",
        ]
    return lines


def transfer_rows(r: Mapping[str, Any]) -> dict[str, dict[int, Mapping[str, Any]]]:
    """method -> size in MB -> its row."""
    out: dict[str, dict[int, Mapping[str, Any]]] = {}
    for row in r["results"]:
        out.setdefault(row["method"], {})[int(row["size_mb"])] = row
    return out


def transfer_table(r: Mapping[str, Any]) -> list[str]:
    by = transfer_rows(r)
    sizes = sorted({s for rows in by.values() for s in rows})
    rows = []
    for method, label in TRANSFER_METHODS:
        if method in by:
            rows.append([label, *[_num(by[method].get(s, {}).get("mb_per_s"), 0) for s in sizes]])
    if "raw-tcp" in by and "torch+stream" in by:
        rows.append(
            [
                "torch + stream / raw TCP",
                *[
                    f"{by['torch+stream'][s]['mb_per_s'] / by['raw-tcp'][s]['mb_per_s']:.0%}"
                    if s in by["torch+stream"] and s in by["raw-tcp"]
                    else "-"
                    for s in sizes
                ],
            ]
        )
        rows.append(
            [
                "torch + stream: seconds",
                *[_num(by["torch+stream"].get(s, {}).get("seconds"), 3) for s in sizes],
            ]
        )
    return _table(("MB/s", *[_size(s) for s in sizes]), rows)


def _size(mb: int) -> str:
    return f"{mb / 1000:g} GB" if mb >= 1000 else f"{mb} MB"


def tables(results: Mapping[str, Any]) -> str:
    """Every section present in ``results``, as markdown."""
    env = results.get("environment", {})
    lines = [
        f"Run of {env.get('date', '?')} on {env.get('host', '?')} ({env.get('cpus', '?')} CPUs), "
        f"sizing `{env.get('sizing', '?')}`; plots in `docs/img/bench-*.png`.",
        "",
    ]
    sections = (
        ("overhead", "Steady-state overhead", overhead_table, "bench-overhead.png"),
        ("recovery", "Recovery-time split, one fault of each kind", recovery_table, "bench-recovery.png"),
        (
            "detection",
            "Detection and recovery by kind of fault, current and previous settings",
            detection.table,
            None,
        ),
        ("completion", "Job completion time with node failures", completion_table, "bench-completion.png"),
        ("transfer", "State transfer against raw TCP, c4 to c5", transfer_table, "bench-transfer.png"),
    )
    for key, title, render, image in sections:
        if key in results:
            lines += [f"### {title}", "", *render(results[key]), ""]
            lines += [f"![{title}](img/{image})", ""] if image else []
    return "\n".join(lines).rstrip() + "\n"


def update_doc(text: str, generated: str) -> str:
    """``text`` with the part between the markers replaced by ``generated``."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"{DOC} has no generated part (the markers {BEGIN!r} and {END!r})")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{generated}{END}{tail}"


# --- plots --------------------------------------------------------------------------------


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def plot_overhead(r: Mapping[str, Any], path: Path) -> None:
    fig = _figure(6, 3.6)
    ax = fig.add_subplot()
    names = (("plain", "plain srun + DDP"), ("tp", "tp run (1 hot spare)"))
    for i, (key, _label) in enumerate(names):
        values = [run["tokens_per_s"] for run in r["runs"][key]]
        ax.bar(i, statistics.median(values), color=("tab:gray", "tab:blue")[i], width=0.6)
        ax.scatter([i] * len(values), values, color="black", zorder=3, s=14, label="runs" if i else None)
        ax.annotate(
            f"{statistics.median(values):.0f}",
            (i, statistics.median(values)),
            ha="center",
            va="bottom",
            xytext=(0, 3),
            textcoords="offset points",
        )
    ax.set_xticks([0, 1], [label for _, label in names])
    ax.set_ylabel("tokens per second (median)")
    ax.set_title(f"Steady-state throughput: {r['overhead_percent']:+.1f} % under tp run")
    ax.legend(loc="lower right")
    fig.savefig(path)


def plot_recovery(r: Mapping[str, Any], path: Path) -> None:
    fig = _figure(8, 3.4)
    ax = fig.add_subplot()
    kinds = [k for k in FAULT_KINDS if r.get(k)]
    colors = ("tab:red", "tab:orange", "tab:purple", "tab:olive", "tab:cyan", "tab:blue")
    for y, kind in enumerate(kinds):
        phases = _first_fault(r[kind]).get("phases", {})
        left = 0.0
        for phase, label, color in zip(PHASES, PHASE_LABELS, colors, strict=False):
            width = phases.get(phase) or 0.0
            ax.barh(y, width, left=left, color=color, label=label if y == 0 else None)
            left += width
        ax.annotate(f"{left:.1f} s", (left, y), va="center", xytext=(4, 0), textcoords="offset points")
    ax.set_yticks(range(len(kinds)), kinds)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the last heartbeat (unplanned) or the drain to the first step after it")
    ax.set_title("Where the recovery time goes (tp report's phases)")
    ax.legend(ncols=3, fontsize="small", loc="lower right")
    ax.margins(x=0.12)
    fig.savefig(path)


def plot_completion(r: Mapping[str, Any], path: Path) -> None:
    rows = completion_rows(r)
    fig = _figure(9, 3.6)
    ax = fig.add_subplot()
    colors = {"no_fault": "tab:gray", "live": "tab:blue", "restart": "tab:orange", "requeue": "tab:red"}
    for y, row in enumerate(rows):
        ax.barh(y, row["seconds"], color=colors[row["key"]])
        note = f"{row['seconds']:.0f} s"
        if row["key"] != "no_fault":
            note += f"  (+{row['excess']:.0f} s, {_steps(row['recomputed'])} steps recomputed)"
        ax.annotate(note, (row["seconds"], y), va="center", xytext=(4, 0), textcoords="offset points")
    ax.set_yticks(range(len(rows)), [SHORT_LABELS[row["key"]] for row in rows])
    ax.invert_yaxis()
    ax.set_xlabel("job completion time (s), from its first start to its end")
    ax.set_title(f"The same training with {len(r['fault_steps'])} nodes powered off")
    ax.margins(x=0.45)
    fig.savefig(path)


def plot_transfer(r: Mapping[str, Any], path: Path) -> None:
    by = transfer_rows(r)
    fig = _figure(9, 3.6)
    rate, took = fig.subplots(1, 2)
    for method, label in TRANSFER_METHODS:
        if method not in by:
            continue
        sizes = sorted(by[method])
        rate.plot(sizes, [by[method][s]["mb_per_s"] for s in sizes], marker="o", label=label)
        took.plot(sizes, [by[method][s]["seconds"] for s in sizes], marker="o", label=label)
    for ax in (rate, took):
        ax.set_xscale("log")
        ax.set_xlabel("state size (MB)")
        ax.grid(True, which="both", alpha=0.3)
    took.set_yscale("log")
    rate.set_ylabel("MB/s (best of the runs)")
    took.set_ylabel("seconds")
    rate.set_title("Throughput between two containers")
    took.set_title("Transfer time against state size")
    rate.legend(fontsize="small")
    fig.savefig(path)


PLOTS = (
    ("overhead", "bench-overhead.png", plot_overhead),
    ("recovery", "bench-recovery.png", plot_recovery),
    ("completion", "bench-completion.png", plot_completion),
    ("transfer", "bench-transfer.png", plot_transfer),
)


def write_plots(results: Mapping[str, Any], img_dir: Path = IMG_DIR) -> list[Path]:
    """One PNG per section present; the paths written."""
    img_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for key, name, plot in PLOTS:
        if key in results:
            plot(results[key], img_dir / name)
            written.append(img_dir / name)
    return written


def render(results: Mapping[str, Any], doc: Path = DOC, img_dir: Path = IMG_DIR) -> str:
    """Tables into the doc, plots into img_dir; the tables (to print)."""
    generated = tables(results)
    doc.write_text(update_doc(doc.read_text(), generated))
    write_plots(results, img_dir)
    return generated


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Redraw docs/benchmarks.md's tables and the plots from a suite JSON."
    )
    p.add_argument("results", type=Path, help="the JSON benchmarks/suite.py wrote")
    args = p.parse_args(argv)
    print(render(json.loads(args.results.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
