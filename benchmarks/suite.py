"""The benchmark suite: every comparison on the dockerized cluster, in one run.

    scripts/bench [--quick] [--only overhead,recovery,detection,completion,transfer,peers]
    scripts/bench --campaign N [--campaign-seed S]   N faults of six classes (benchmarks/campaign.py)
    scripts/bench --campaign N --faults-per-job K    long-life jobs of K faults on 1 spare (long_life.py)
    python3 -m benchmarks.suite ...   (the same; scripts/bench checks the Python environment first)

It starts the dockerized cluster if it is not running, and then takes it down again.

Runs the parts in :mod:`benchmarks.runs`, writes their results to JSON
(``benchmarks/results/suite.json``; with ``--only`` the other parts of an
existing file are kept), prints the markdown tables, writes them into
docs/benchmarks.md (between its markers) and draws docs/img/bench-*.png.
Numbers depend on the machine and its load: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks import campaign, detection, jobs, long_life, manifest, peers, render, runs
from scripts.devcluster import ClusterError

PARTS = {
    "overhead": runs.overhead,
    "recovery": runs.recovery,
    "detection": detection.detection,
    "completion": runs.completion,
    "transfer": runs.transfer,
}
#: Parts run only when asked for with --only (peers needs the bookworm flavor: torchft needs torch >= 2.7).
OPTIONAL_PARTS = {"peers": lambda size: peers.peers()}
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "suite.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.suite", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--only",
        default=",".join(PARTS),
        help=f"comma-separated parts to run (default all: {','.join(PARTS)})",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a small model and short runs: checks the suite works (numbers mean little)",
    )
    p.add_argument(
        "--failures",
        type=int,
        choices=(1, 2),
        default=2,
        help="node failures in the completion runs (default 2; the cluster has 5 nodes: "
        "3 active and one spare per failure)",
    )
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"results file (default {DEFAULT_JSON})")
    p.add_argument("--no-doc", action="store_true", help="do not touch docs/benchmarks.md and docs/img")
    p.add_argument(
        "--campaign",
        type=int,
        metavar="N",
        nargs="?",
        const=50,
        default=None,
        help="instead of the parts: a fault campaign of N faults (default 50) drawn from a seeded "
        "generator (benchmarks/campaign.py); results in benchmarks/results/campaign.json",
    )
    p.add_argument("--campaign-seed", type=int, default=14, help="seed of the campaign's faults (default 14)")
    p.add_argument(
        "--faults-per-job",
        type=int,
        metavar="K",
        default=None,
        help="with --campaign: long-life jobs of K faults each on one spare, the pool refilled "
        "between them (benchmarks/long_life.py); results in benchmarks/results/long-life.json",
    )
    args = p.parse_args(argv)
    if args.faults_per_job is not None and (not args.campaign or args.faults_per_job < 1):
        p.error("--faults-per-job K needs --campaign N, and K of at least 1")
    args.parts = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in args.parts if s not in PARTS and s not in OPTIONAL_PARTS]
    if unknown or not args.parts:
        p.error(
            f"--only: unknown part(s) {', '.join(unknown) or '(none given)'}; "
            f"the parts are {', '.join([*PARTS, *OPTIONAL_PARTS])}"
        )
    return args


def environment(sizing: str) -> dict[str, Any]:
    torch = jobs.on("ctl", "python3", "-c", "import torch; print(torch.__version__)").strip()
    slurm = jobs.on("ctl", "sinfo", "--version").strip()
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "node_torch": torch,
        "slurm": slurm,
        "sizing": sizing,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict[str, Any] = {}
    if args.json.exists() and set(args.parts) != set(PARTS):
        results = json.loads(args.json.read_text())
    try:
        started = not jobs.CLUSTER.is_up()
        if started:
            jobs.progress("the test cluster is not running: starting it (scripts/cluster up)")
            jobs.CLUSTER.up()
    except (ClusterError, OSError) as err:
        sys.exit(f"cannot start the test cluster: {err}")
    try:
        return run_campaign(args) if args.campaign else run_suite(args, results)
    finally:
        if started:
            jobs.progress("taking the cluster down again (scripts/cluster down)")
            jobs.CLUSTER.down()


def run_suite(args: argparse.Namespace, results: dict[str, Any]) -> int:
    size = runs.QUICK if args.quick else runs.Sizing()
    size = dataclasses.replace(size, completion_failures=args.failures)
    try:
        jobs.wait_idle(timeout=60)
    except (ClusterError, OSError) as err:
        sys.exit(f"the test cluster is not idle ({err}); see `scripts/cluster status`")
    results["environment"] = environment("quick" if args.quick else "default")
    results["sizing"] = {k: getattr(size, k) for k in size.__dataclass_fields__}
    began = time.monotonic()
    for part in args.parts:
        part_began = time.monotonic()
        try:
            results[part] = {**PARTS, **OPTIONAL_PARTS}[part](size)
        except ClusterError as err:
            sys.exit(f"benchmark part {part!r} failed: {err}")
        jobs.progress(f"{part}: done in {time.monotonic() - part_began:.0f} s")
        manifest.write_result(args.json, results, indent=2)  # a crash later keeps this part
    jobs.progress(f"suite done in {time.monotonic() - began:.0f} s; results in {args.json}")
    if args.no_doc:
        print(render.tables(results))
    else:
        print(render.render(results))
        jobs.progress(f"tables written into {render.DOC}, plots into {render.IMG_DIR}")
    return 0


def run_campaign(args: argparse.Namespace) -> int:
    """scripts/bench --campaign N: the fault campaign, its table, its JSON."""
    try:
        jobs.wait_idle(timeout=60)
    except (ClusterError, OSError) as err:
        sys.exit(f"the test cluster is not idle ({err}); see `scripts/cluster status`")
    if args.faults_per_job:
        result = long_life.long_life(args.campaign, args.faults_per_job, args.campaign_seed)
        default, text = long_life.DEFAULT_JSON, long_life.table(result)
    else:
        result = campaign.campaign(args.campaign, args.campaign_seed)
        default, text = campaign.DEFAULT_JSON, f"{campaign.table(result)}\n{result['tp_report_totals_only']}"
    result["environment"] = environment("campaign")
    path = default if args.json == DEFAULT_JSON else args.json
    manifest.write_result(path, result)
    print(text)
    jobs.progress(f"campaign done in {result['seconds']:.0f} s; results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
