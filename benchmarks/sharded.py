"""Sharded live migration on the bookworm dev cluster: what a recovery moves and where its time goes.

    TP_CLUSTER_FLAVOR=bookworm python3 -m benchmarks.sharded [--json F] [--steps N] [--no-transfer]

One training (tiny_gpt, the same model, data and seed) on 4 active nodes and 1 hot spare,
one node powered off mid-run, under three layouts in one run:

- ``ddp``: plain data parallelism (sbatch-examples/tiny_gpt_tp.sbatch): the spare receives the
  full state from a replica. The baseline.
- ``hsdp 2x2``: FSDP2 on a (replicate, shard) mesh (tiny_gpt_hsdp_tp.sbatch): the spare
  receives only the lost rank's shard, from the rank with its coordinate in the other replica.
- ``fsdp 1x4`` drained: pure FSDP has no replica, so the move is a planned one: the leaving
  rank sends its own shard over a socket.

For each: the bytes moved against the full training state (parameters and AdamW's two
moments), and the recovery split of ``tp report`` (detect, decide, rebuild, agree, transfer,
first step). Then, unless ``--no-transfer``, the transfer transports between two nodes in one
run (``srun --mpi=pmi2 benchmarks/transfer_bench.py``): raw TCP, the socket and torch
transports with the stream, and MPICH connect/accept. It starts the cluster if it is not up,
and takes down what it started. Numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import jobs, manifest
from scripts import devcluster
from torchpass_slurm.analysis.report_totals import job_json
from torchpass_slurm.cli.report import load_report

HSDP_SCRIPT = "/src/sbatch-examples/tiny_gpt_hsdp_tp.sbatch"
#: The model of every run: 4 layers of d_model 128 (about 0.9 M parameters).
MODEL = (
    "--d-model",
    "128",
    "--n-layers",
    "4",
    "--context",
    "32",
    "--batch-size",
    "8",
    "--seed",
    "1234",
    "--log-every",
    "4",
    "--step-sleep",
    "0.3",
)
SPLIT = ("detection", "decision", "rebuild", "agreement", "transfer", "first_step", "total")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.sharded", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="steps of each run (default 30)")
    p.add_argument("--fault-at", type=int, default=6, help="the committed step of the fault (default 6)")
    p.add_argument("--no-transfer", action="store_true", help="skip the transport comparison")
    p.add_argument("--json", type=Path, help="write the results here")
    return p.parse_args(argv)


def submit(script: str, args: list[str]) -> jobs.Job:
    folder = jobs.new_folder("sharded")
    job_id = jobs.CLUSTER.tp_submit(folder, "-N", "4", "--spares", "1", script, *args)
    return jobs.Job(job_id, folder, time.monotonic())


def full_state_bytes(job: jobs.Job) -> int:
    """Parameters and AdamW's exp_avg and exp_avg_sq, float32: 12 bytes per parameter."""
    for line in job.output().splitlines():
        if "model:" in line and "parameters" in line:
            return 12 * int(line.split("model:")[1].split("parameters")[0].replace(",", "").strip())
    raise jobs.BenchError(f"job {job.job_id} printed no model size")


def one(name: str, script: str, args: list[str], fault: jobs.Injector, at: int) -> dict[str, Any]:
    jobs.wait_idle()
    jobs.progress(f"sharded: {name}")
    job = jobs.run(submit(script, args), jobs.tp_progress, [(at, fault)])
    jobs.restart_nodes([f["node"] for f in job.faults if f["kind"] == "kill"])
    report = job_json(load_report(jobs.CLUSTER.host_path(job.folder)))
    events = [json.loads(line) for line in job.event_log().read_text().splitlines()]
    transfers = [e for e in events if e["kind"] == "transfer_done"]
    full = full_state_bytes(job)
    moved = sum(int(t["bytes"]) for t in transfers)
    faults = report.get("faults", [])
    split = faults[0].get("phases", {}) if faults else {}
    return {
        "name": name,
        "job": job.job_id,
        "state": job.state,
        "seconds": round(job.seconds, 2),
        "full_state_bytes": full,
        "bytes_moved": moved,
        "share_moved": round(moved / full, 4),
        "transfers": transfers,
        "resolution": faults[0].get("resolution") if faults else None,
        "split": split,
        "faults": faults,
    }


def render(result: dict[str, Any]) -> str:
    rows = [
        "| layout | fault | resolution | bytes moved | of the full state | " + " | ".join(SPLIT) + " |",
        "|---|---|---|---|---|" + "---|" * len(SPLIT),
    ]
    for r in result["runs"]:
        split = r["split"] or {}
        cells = [f"{split[k]:.2f}" if isinstance(split.get(k), (int, float)) else "-" for k in SPLIT]
        rows.append(
            f"| {r['name']} | {r['fault']} | {r['resolution']} | {r['bytes_moved']:,} | "
            f"{100 * r['share_moved']:.1f} % | " + " | ".join(cells) + " |"
        )
    return "\n".join(rows)


def transports() -> dict[str, Any]:
    jobs.wait_idle()
    jobs.progress("sharded: transports between c4 and c5 (srun --mpi=pmi2)")
    folder = jobs.new_folder("transfer")
    printed = jobs.on(
        "ctl",
        "srun",
        "-N2",
        "-n2",
        "--nodelist=c4,c5",
        "--mpi=pmi2",
        "python3",
        "/src/benchmarks/transfer_bench.py",
        "--sizes",
        "10,100,500",
        "--json",
        f"{folder}/transfer.json",
    )
    result = jobs.read_json(jobs.CLUSTER.host_path(f"{folder}/transfer.json"))
    result["printed"] = "\n".join(line for line in printed.splitlines() if "UCX  WARN" not in line)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if devcluster.FLAVOR.name != "bookworm":
        print(
            "benchmarks.sharded runs on the bookworm dev cluster (FSDP2 needs torch 2.13): "
            "TP_CLUSTER_FLAVOR=bookworm python3 -m benchmarks.sharded",
            file=sys.stderr,
        )
        return 2
    cluster = jobs.CLUSTER
    started = not cluster.is_up()
    if started:
        cluster.up()
    try:
        train = [*MODEL, "--steps", str(args.steps), "--ckpt-every", "10"]
        at = args.fault_at
        kill, drain = jobs.kill_node(jobs.tp_victim), jobs.drain_node(jobs.tp_victim)
        runs = [
            {**one("ddp", jobs.TP_SCRIPT, train, kill, at), "fault": "node powered off"},
            {
                **one("hsdp 2x2", HSDP_SCRIPT, [*train, "--mesh", "2x2"], kill, at),
                "fault": "node powered off",
            },
            {**one("fsdp 1x4", HSDP_SCRIPT, [*train, "--mesh", "1x4"], drain, at), "fault": "admin drain"},
        ]
        result: dict[str, Any] = {
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
            "host": {"machine": platform.machine(), "cpus": os.cpu_count()},
            "slurm": cluster.exec("ctl", "sinfo", "--version").stdout.strip(),
            "train_args": train,
            "fault_at_step": at,
            "runs": runs,
        }
        print(render(result))
        if not args.no_transfer:
            result["transfer"] = transports()
            print(result["transfer"]["printed"])
    finally:
        if started:
            cluster.down()
    if args.json:
        manifest.write_result(args.json, result)
        jobs.progress(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
