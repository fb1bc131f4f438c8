#!/usr/bin/env python3
"""Recovery benchmark on the dockerized cluster: live migration against checkpoint restart.

Runs the example training (sbatch-examples/tiny_gpt.py, 3 active nodes + 1
hot spare) three times in one session and prints, side by side:

- ``baseline``: no fault: the job's completion time;
- ``live``: one node powered off at step --kill-at; the state moves to the spare;
- ``restart``: the same fault with ``TORCHPASS_RECOVERY=restart``: every rank
  restarts from the last checkpoint (the in-allocation baseline).

For the two faulty runs it prints the recovery-time split from ``tp report``
(detection, decision, group rebuild, agreement, transfer, first step), the
committed steps lost and the steps recomputed; the completion time against
the baseline. Then it measures state-transfer throughput and raw TCP between
two of the cluster's containers (benchmarks/transfer_bench.py under srun).

    scripts/cluster up
    python3 benchmarks/recovery_bench.py [--json benchmarks/results/recovery.json]

A script, not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "scripts" / "cluster"
EXAMPLE = "/src/sbatch-examples/tiny_gpt_tp.sbatch"
PHASES = ("detection", "decision", "rebuild", "agreement", "transfer", "first_step", "total")


def on(node: str, *cmd: str, env: dict[str, str] | None = None, check: bool = True) -> str:
    env_args = [a for k, v in (env or {}).items() for a in ("-e", f"{k}={v}")]
    proc = subprocess.run(["docker", "exec", *env_args, f"torchpass-{node}", *cmd],
                          capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        sys.exit(f"on {node}: {' '.join(cmd)} failed: {proc.stderr.strip()}")
    return proc.stdout


def job_state(job: str) -> str:
    return on("ctl", "squeue", "-h", "-j", job, "-o", "%T", check=False).strip() or "DONE"


def status(job: str) -> dict[str, Any]:
    out = on("ctl", "tp", "status", job, "--json", check=False)
    try:
        return json.loads(out)
    except ValueError:
        return {}


def min_active_step(job: str) -> int:
    steps = [n["last_step"] or 0 for n in status(job).get("nodes", []) if n["role"] == "active"]
    return min(steps) if steps else 0


def run_job(train_args: list[str], *, kill_at: int | None, env: dict[str, str] | None) -> dict[str, Any]:
    """Submit, optionally power off one active node at a step, wait; the timings and report."""
    run_dir = f"/shared/runs/bench-{uuid.uuid4().hex[:8]}"
    job = on("ctl", "tp-submit", "--parsable", "-N", "3", "--spares", "1", "--run-dir", run_dir,
             "--output", f"{run_dir}/slurm-%j.out", EXAMPLE, *train_args, env=env).strip()
    started = time.monotonic()
    victim = None
    while job_state(job) not in ("DONE", "COMPLETED", "FAILED", "CANCELLED"):
        if kill_at is not None and victim is None and min_active_step(job) >= kill_at:
            batch = on("ctl", "squeue", "-h", "-j", job, "-o", "%B").strip()
            victim = next(n["node"] for n in status(job)["nodes"]
                          if n["role"] == "active" and n["node"] != batch)
            subprocess.run([str(CLUSTER), "kill", victim], check=True, capture_output=True)
        time.sleep(0.5)
    elapsed = time.monotonic() - started
    report = json.loads(on("ctl", "tp", "report", job, "--json"))
    if victim:
        subprocess.run([str(CLUSTER), "restart", victim], check=True, capture_output=True)
    return {"job": job, "seconds": round(elapsed, 1), "victim": victim, "report": report}


def wait_idle(timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = on("ctl", "sinfo", "-h", "-N", "-o", "%T").split()
        if states and all(s == "idle" for s in states):
            return
        for node in ("c1", "c2", "c3", "c4", "c5"):
            on("ctl", "scontrol", "update", f"nodename={node}", "state=resume", check=False)
        time.sleep(2)
    sys.exit("the cluster's nodes did not all come back idle")


def phase_row(name: str, run: dict[str, Any]) -> list[str]:
    faults = run["report"].get("faults", [])
    if not faults:
        return [name, f"{run['seconds']:.1f}"] + ["-"] * (len(PHASES) + 3)
    f = faults[0]
    phases = f.get("phases", {})
    cells = [_fmt(phases.get(p)) for p in PHASES]
    return [name, f"{run['seconds']:.1f}", f.get("resolution") or "-", *cells,
            str(f.get("lost_steps")), str(f.get("recomputed_steps"))]


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_table(rows: list[list[str]]) -> None:
    header = ["run", "job s", "resolution", *PHASES, "lost", "recomputed"]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))


def transfer_numbers() -> str:
    """benchmarks/transfer_bench.py between two compute containers (srun -N2)."""
    return on("ctl", "srun", "-N2", "-n2", "--nodelist=c4,c5", "python3",
              "/src/benchmarks/transfer_bench.py", "--sizes", "10,100,500", "--no-mpi")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-at", type=int, default=16)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--model", default="256,4", help="d_model,n_layers (default 256,4: 3.3 M params)")
    p.add_argument("--json", help="write the results to this JSON file")
    args = p.parse_args(argv)
    d_model, layers = args.model.split(",")
    train = ["--d-model", d_model, "--n-layers", layers, "--steps", str(args.steps),
             "--ckpt-every", str(args.ckpt_every), "--log-every", "10", "--step-sleep", "0.2"]
    results: dict[str, Any] = {"train_args": train, "kill_at": args.kill_at}
    for name, kill, env in (("baseline", None, None), ("live", args.kill_at, None),
                            ("restart", args.kill_at, {"TORCHPASS_RECOVERY": "restart"})):
        wait_idle()
        print(f"running {name} ...", file=sys.stderr, flush=True)
        results[name] = run_job(train, kill_at=kill, env=env)
    print_table([phase_row(n, results[n]) for n in ("baseline", "live", "restart")])
    base = results["baseline"]["seconds"]
    for name in ("live", "restart"):
        extra = results[name]["seconds"] - base
        print(f"{name}: the fault cost {extra:.1f} s of job time over the baseline ({base:.1f} s)")
    wait_idle()
    print("\nstate transfer against raw TCP, between c4 and c5:", flush=True)
    results["transfer"] = transfer_numbers()
    print(results["transfer"])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
