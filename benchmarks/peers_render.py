"""Plots of the side-by-side run and the fault campaign (docs/img/bench-peers-*.png, bench-campaign.png).

    python3 -m benchmarks.peers_render [--peers benchmarks/results/peers.json]
                                       [--campaign benchmarks/results/campaign.json]

Pure data in, PNG out, with matplotlib's object API on the Agg canvas (render.py's _figure).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.peers import CASE_LABELS, SYSTEM_LABELS, job_seconds
from benchmarks.render import IMG_DIR, _figure

RESULTS = Path(__file__).resolve().parent / "results"
COLORS = {
    "torchpass": "tab:blue",
    "torchft": "tab:green",
    "torchft-fixed": "tab:olive",
    "restart": "tab:orange",
    "requeue": "tab:red",
}
FAULT_CASES = ("node_kill", "rank_kill", "drain")


def recovery_points(r: Mapping[str, Any]) -> dict[str, dict[str, float | None]]:
    """system -> fault case -> the mean time from a fault to the next committed step (None: never)."""
    out: dict[str, dict[str, float | None]] = {}
    for system, cases in r["systems"].items():
        out[system] = {}
        for case in FAULT_CASES:
            values = [v for v in cases[case].get("recoveries_s") or [] if v is not None]
            out[system][case] = sum(values) / len(values) if values else None
    return out


def plot_recovery(r: Mapping[str, Any], path: Path) -> None:
    points = recovery_points(r)
    systems = list(points)
    fig = _figure(9, 3.8)
    ax = fig.add_subplot()
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        for x, case in enumerate(FAULT_CASES):
            value = points[system][case]
            pos = x + (i - (len(systems) - 1) / 2) * width
            label = SYSTEM_LABELS[system] if x == 0 else None
            ax.bar(pos, value or 0.0, width, color=COLORS[system], label=label)
            note = "no step\nafter it" if value is None else f"{value:.1f}"
            ax.annotate(
                note,
                (pos, value or 0.0),
                ha="center",
                va="bottom",
                fontsize="x-small",
                xytext=(0, 2),
                textcoords="offset points",
            )
    ax.set_xticks(range(len(FAULT_CASES)), [CASE_LABELS[c].replace("2 nodes", "a node") for c in FAULT_CASES])
    ax.set_yscale("symlog", linthresh=10)
    ax.set_ylabel("seconds, fault to the next committed step")
    ax.set_title("Recovery by fault class and system (one run, same cluster)")
    ax.legend(fontsize="small")
    fig.savefig(path)


def plot_completion(r: Mapping[str, Any], path: Path) -> None:
    rows = []
    for system, cases in r["systems"].items():
        base, run = job_seconds(cases["no_fault"]), cases["node_kill"]
        rows.append((system, base, job_seconds(run), run["state"]))
    fig = _figure(9, 3.4)
    ax = fig.add_subplot()
    for y, (system, base, seconds, state) in enumerate(rows):
        ax.barh(y, seconds, color=COLORS[system])
        ax.barh(y, base, color="none", edgecolor="black", linestyle="--")
        end = "" if state == "COMPLETED" else f", {state}"
        ax.annotate(
            f"{seconds:.0f} s ({seconds / base:.2f} x its fault-free {base:.0f} s){end}",
            (seconds, y),
            va="center",
            xytext=(4, 0),
            textcoords="offset points",
            fontsize="small",
        )
    ax.set_yticks(range(len(rows)), [SYSTEM_LABELS[s] for s, *_ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("job time (s), 2 nodes powered off; dashed: the same system, no fault")
    ax.set_title("Job completion, four systems, the same training and faults")
    ax.margins(x=0.6)
    fig.savefig(path)


def plot_campaign(r: Mapping[str, Any], path: Path) -> None:
    t = r["totals"]
    names = [*t["by_class"], "all"]
    rows = [*t["by_class"].values(), t["all"]]
    fig = _figure(9, 3.6)
    ax = fig.add_subplot()
    width = 0.27
    bars = (
        ("share_live", "live, no lost progress", "tab:blue"),
        ("share_no_data_loss", "no data loss", "tab:green"),
        ("share_bitwise_among_live", "bitwise equal (of the live)", "tab:gray"),
    )
    for i, (key, label, color) in enumerate(bars):
        values = [100 * (row[key] or 0.0) for row in rows]
        ax.bar([x + (i - 1) * width for x in range(len(rows))], values, width, color=color, label=label)
    ticks = [f"{n}\n({row['faults']})" for n, row in zip(names, rows, strict=True)]
    ax.set_xticks(range(len(rows)), ticks, fontsize="small")
    ax.set_ylim(0, 105)
    ax.set_ylabel("% of the faults")
    ax.set_title(f"Fault campaign: {t['all']['faults']} faults, seed {r['seed']}")
    ax.legend(fontsize="small", loc="lower left")
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python3 -m benchmarks.peers_render", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--peers", type=Path, default=RESULTS / "peers.json")
    p.add_argument("--campaign", type=Path, default=RESULTS / "campaign.json")
    a = p.parse_args(argv)
    IMG_DIR.mkdir(parents=True, exist_ok=True)
    if a.peers.exists():
        r = json.loads(a.peers.read_text())
        plot_recovery(r, IMG_DIR / "bench-peers-recovery.png")
        plot_completion(r, IMG_DIR / "bench-peers-completion.png")
    if a.campaign.exists():
        plot_campaign(json.loads(a.campaign.read_text()), IMG_DIR / "bench-campaign.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
