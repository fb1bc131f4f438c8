"""Job completion with node kills under live migration, against the fault-free run, in pairs.

The suite's completion part (``benchmarks/runs.py``) runs each mode once: a
ratio of two single runs on a shared 2-core host is as noisy as the host
(steps of the same training measured 1.31 s in one run and 1.47 s in the
next). This script alternates the two runs the issue compares, ``pairs``
times, with the suite's default sizing (100 steps, checkpoints every 20,
0.3 s sleep per step, 3 active nodes, one hot spare per kill)::

    fault-free, live (F nodes powered off), fault-free, live, ...

and prints each run's job time, the medians, their ratio, and each live
run's recoveries (fault to first committed step, from the event log) with
the seconds per step before the first fault, so that a slower run is seen
as such. Run::

    python -m benchmarks.experiments.completion_pairs [--pairs 2] [--failures 2] [--json FILE]

Needs the dockerized cluster up (``scripts/cluster up``). A script, not a
test: the numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks import jobs
from benchmarks.runs import Sizing
from torchpass_slurm.rundir import events as ev


def recoveries(job: jobs.Job) -> list[float]:
    """Seconds from each injected fault to the next first committed step."""
    events = ev.read_events(job.event_log())
    firsts = [e.ts for e in events if e.kind == ev.FIRST_STEP]
    return [
        round(min((t for t in firsts if t > f["wall"]), default=float("nan")) - f["wall"], 2)
        for f in job.faults
    ]


def kill_timed(job: jobs.Job) -> dict[str, Any]:
    """Power loss of an active node that is not the batch host, with the wall time of the cut."""
    node, wall = jobs.tp_victim(job), time.time()
    jobs.CLUSTER.kill(node)
    return {"kind": "kill", "node": node, "wall": wall}


def one(args: list[str], spares: int, faults: tuple[int, ...]) -> dict[str, Any]:
    jobs.wait_idle()
    injections = [(at, kill_timed) for at in faults]
    job = jobs.run(jobs.submit_tp(args, spares=spares), jobs.tp_progress, injections)
    out: dict[str, Any] = {"job": job.job_id, "state": job.state, "seconds": round(job.seconds, 2)}
    if faults:
        out["recoveries_s"] = recoveries(job)
        jobs.restart_nodes([f["node"] for f in job.faults])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.experiments.completion_pairs", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--pairs", type=int, default=2, help="fault-free/live pairs (default 2)")
    p.add_argument("--failures", type=int, choices=(1, 2), default=2, help="nodes powered off per live run")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    a = p.parse_args(argv)
    size = Sizing(completion_failures=a.failures)
    faults = size.fault_steps(size.completion_failures)
    args = size.train_args(size.completion_steps, ckpt_every=size.ckpt_every, step_sleep=size.step_sleep)
    spares = len(faults)
    runs: dict[str, list[dict[str, Any]]] = {"no_fault": [], "live": []}
    for i in range(a.pairs):
        for mode, at in (("no_fault", ()), ("live", faults)):
            jobs.progress(f"pair {i + 1}/{a.pairs}: {mode}")
            runs[mode].append(one(args, spares, at))
            jobs.progress(f"  {runs[mode][-1]}")
    median = {m: statistics.median(r["seconds"] for r in rs) for m, rs in runs.items()}
    result = {
        "train_args": args,
        "fault_steps": list(faults),
        "runs": runs,
        "median_s": median,
        "ratio": round(median["live"] / median["no_fault"], 3),
    }
    print("| run | " + " | ".join(f"pair {i + 1}" for i in range(a.pairs)) + " | median |")
    print("|---|" + "---|" * (a.pairs + 1))
    for mode, rs in runs.items():
        print(f"| {mode} (s) | " + " | ".join(f"{r['seconds']:.1f}" for r in rs) + f" | {median[mode]:.1f} |")
    print(
        f"live / fault-free (medians): {result['ratio']:.3f}x; fault to first step (s): "
        + ", ".join(str(r["recoveries_s"]) for r in runs["live"])
    )
    if a.json is not None:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all(r["state"] == "COMPLETED" for rs in runs.values() for r in rs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
