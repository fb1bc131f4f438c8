"""torchpass against torchft on HSDP 2 x 2: the peers benchmark for a sharded training (issue 14).

    TP_CLUSTER_FLAVOR=bookworm python3 -m benchmarks.peers_hsdp [--json F] [--rounds N]
                                                               [--cases no_fault,node_kill,rank_kill]

The two systems train tiny_gpt's model with FSDP2 on a (replicate 2, shard 2) mesh, one rank
per node, on the same data with the same seed and steps (the quick sizing of
``benchmarks.peers``), 4 training nodes and 1 spare:

    torchpass  tp-submit -N 4 --spares 1 tiny_gpt_hsdp_tp.sbatch --mesh 2x2 (as benchmarks.sharded
               and tests/cluster_sharded submit it): a lost rank's shards come live from its
               replica onto the hot spare
    torchft    sbatch -N 5 --no-kill tiny_gpt_torchft.sbatch with TORCHFT_GROUPS=2,
               TORCHFT_GROUP_SIZE=2 (tiny_gpt_torchft_hsdp.py, TorchTitan's wiring of torchft
               0.2.0): 2 replica groups of 2 FSDP ranks, the replicate dimension torchft's
               Manager through FSDP's all-reduce hook; a failed group restarts cold, on the
               spare for a node that is gone, and heals shard by shard from the healthy group

Each meets the same faults at the same committed step, next to a fault-free run of its own: a
node powered off (not the batch host, where the supervisor and the Lighthouse live) and, with
``--cases``, a rank process SIGKILLed. Measured per run: job time, the time from the fault to
the next committed step (torchpass: its ``first_step`` event; torchft: the first commit in a
new quorum), committed steps lost, steps committed by fewer than 2 replica groups (torchft
trains on without the lost group: its samples of those steps are never trained), final loss
(the mean over the 4 ranks) and whether the final parameters and optimizer state equal the
system's fault-free run bit for bit. Then the steady-state throughput (no fault, no sleep, no
checkpoint), the systems alternated. It starts the cluster if it is not up and takes down what
it started. Needs the bookworm flavor (FSDP2 and torchft need torch >= 2.7).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import jobs, manifest, peers, sharded

SYSTEMS = ("torchpass", "torchft")
SYSTEM_LABELS = {
    "torchpass": "torchpass HSDP 2x2 (live migration, 1 hot spare)",
    "torchft": "torchft 0.2.0 HSDP 2x2 (TorchTitan's wiring, 1 idle node)",
}
CASES = ("no_fault", "node_kill", "rank_kill")
CASE_LABELS = {
    "no_fault": "no fault",
    "node_kill": "a node powered off",
    "rank_kill": "rank process SIGKILLed",
}
#: The training process of each system, as ``pkill -f`` finds it on a node.
PATTERNS = {
    "torchpass": "sbatch-examples/tiny_gpt_hsdp.py",
    "torchft": "benchmarks/peer_drivers/tiny_gpt_torchft_hsdp.py",
}
TORCHFT_ENV = "TORCHFT_GROUPS=2,TORCHFT_GROUP_SIZE=2"
#: Replica groups of the mesh (its replicate dimension).
REPLICAS = 2
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class HsdpSizing(peers.PeerSizing):
    """benchmarks.peers's quick runs on the 2 x 2 mesh: one node lost at step 8, one spare."""

    kills_at: tuple[int, ...] = (8,)
    spares: int = 1

    def train_args(self, steps: int, sleep: float, ckpt_every: int) -> list[str]:
        return [*super().train_args(steps, sleep, ckpt_every), "--mesh", "2x2"]


# --- submitting, breaking ------------------------------------------------------------------


def submit(system: str, args: Sequence[str]) -> jobs.Job:
    if system == "torchpass":
        return sharded.submit(sharded.HSDP_SCRIPT, list(args))
    folder = jobs.new_folder("torchft-hsdp")
    job_id = jobs.CLUSTER.sbatch(
        "-N",
        "5",
        "--no-kill",
        "--output",
        f"{folder}/slurm-%j.out",
        f"--export=ALL,TORCHFT_LOG_DIR={folder},{TORCHFT_ENV}",
        "--chdir",
        folder,
        peers.TORCHFT_SCRIPT,
        *args,
    )
    return jobs.Job(job_id, folder, time.monotonic())


def torchft_victim_of(records: Iterable[Mapping[str, Any]], gone: set[str]) -> str:
    """The node of the highest (group, rank) as last started that is not in ``gone`` (the batch
    host, nodes already powered off): a rank of the last group, away from the Lighthouse."""
    latest: dict[tuple[int, int], str] = {}
    for r in records:
        if r.get("event") == "start":
            latest[(int(r["group"]), int(r.get("rank", 0)))] = str(r["node"])
    nodes = [node for _, node in sorted(latest.items()) if node not in gone]
    if not nodes:
        raise jobs.BenchError("the torchft job has no rank outside its batch host yet")
    return nodes[-1]


def victim(system: str, job: jobs.Job) -> str:
    if system == "torchpass":
        return jobs.tp_victim(job)
    gone = {f["node"] for f in job.faults if f["kind"] == "kill"} | {
        jobs.CLUSTER.job_field(job.job_id, "BatchHost")
    }
    return torchft_victim_of(peers.torchft_records(job), gone)


def injector(kind: str, system: str) -> jobs.Injector:
    def inject(job: jobs.Job) -> dict[str, Any]:
        node, wall = victim(system, job), time.time()
        if kind == "kill":
            jobs.CLUSTER.kill(node)
        else:
            jobs.on(node, "pkill", "-KILL", "-f", PATTERNS[system], check=False)
        return {"kind": kind, "node": node, "wall": wall}

    return inject


PROGRESS: dict[str, Callable[[jobs.Job], int]] = {
    "torchpass": jobs.tp_progress,
    "torchft": peers.torchft_progress,
}


# --- one run -----------------------------------------------------------------------------------


def run_case(system: str, case: str, size: HsdpSizing) -> dict[str, Any]:
    args = size.train_args(size.steps, size.step_sleep, size.ckpt_every)
    plan: list[tuple[int, jobs.Injector]] = {
        "no_fault": [],
        "node_kill": [(at, injector("kill", system)) for at in size.kills_at],
        "rank_kill": [(size.fault_at, injector("rank-kill", system))],
    }[case]
    jobs.wait_idle()
    jobs.progress(f"peers-hsdp: {system}, {CASE_LABELS[case]}")
    clock = peers.StepClock(PROGRESS[system])
    job = submit(system, args)
    try:
        jobs.run(job, clock, plan)
    except jobs.BenchError as err:  # a system that does not survive a fault is a result
        jobs.progress(f"  {err}")
        job.ended = job.ended or time.monotonic()
    out: dict[str, Any] = {
        "job": job.job_id,
        "state": job.state,
        "folder": job.folder,
        "seconds": round(job.seconds, 2),
        "timeline": job.timeline,
        "injected": job.faults,
        **outcome(system, job, clock, size),
    }
    jobs.restart_nodes([f["node"] for f in job.faults if f["kind"] == "kill"])
    return out


def outcome(system: str, job: jobs.Job, clock: peers.StepClock, size: HsdpSizing) -> dict[str, Any]:
    if system == "torchft":
        return peers.torchft_outcome(job, [f["wall"] for f in job.faults], size, replicas=REPLICAS)
    return peers.outcome(system, job, clock, size)


def run_system(
    system: str, cases: Sequence[str], size: HsdpSizing, runs: dict[str, Any], saved: Callable[[], object]
) -> None:
    """The cases of one system into ``runs``, its fault-free run first (the bitwise reference)."""
    for case in ("no_fault", *(c for c in cases if c != "no_fault")):
        run = runs[case] = run_case(system, case, size)
        ref = runs["no_fault"]["params_sha256"]
        run["bitwise_equal_to_no_fault"] = bool(ref) and run["params_sha256"] == ref
        run["measured_at"] = time.strftime("%H:%M:%SZ", time.gmtime())
        saved()  # a crash later keeps what was measured


# --- throughput --------------------------------------------------------------------------------


def throughput_summary(runs: Mapping[str, Sequence[float]]) -> dict[str, Any]:
    """Medians of the alternated rounds, and torchpass against torchft."""
    median = {s: statistics.median(v) for s, v in runs.items() if v}
    both = {"torchpass", "torchft"} <= set(median)
    ratio = round(median["torchpass"] / median["torchft"], 3) if both else None
    return {
        "runs": {s: list(v) for s, v in runs.items()},
        "median_tokens_per_s": median,
        "torchpass_over_torchft": ratio,
    }


def throughput(size: HsdpSizing) -> dict[str, Any]:
    args = size.train_args(size.throughput_steps, 0.0, 0)
    runs: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    for i in range(size.throughput_rounds):
        for system in SYSTEMS if i % 2 == 0 else SYSTEMS[::-1]:  # alternated: ABBA...
            jobs.wait_idle()
            jobs.progress(f"peers-hsdp: throughput, {system} (round {i + 1})")
            job = jobs.run(submit(system, args), PROGRESS[system])
            line = jobs.THROUGHPUT_LINE.search(job.output())
            if not line:
                raise jobs.BenchError(
                    f"{system} job {job.job_id} ended {job.state} without a throughput "
                    f"line (output in {job.folder})"
                )
            runs[system].append(float(line.group(3)))
    return {"train_args": args, **throughput_summary(runs)}


# --- tables -----------------------------------------------------------------------------------


def tables(r: Mapping[str, Any]) -> str:
    lines: list[str] = []
    t = r.get("throughput")
    if t:
        rounds = max(len(v) for v in t["runs"].values())
        heads = " | ".join(f"round {i + 1}" for i in range(rounds))
        lines += [f"| system | {heads} | median tokens/s |", "|---|" + "---|" * (rounds + 1)]
        for s, values in t["runs"].items():
            cells = " | ".join(f"{v:,.0f}" for v in values)
            lines.append(f"| {SYSTEM_LABELS[s]} | {cells} | {t['median_tokens_per_s'][s]:,.0f} |")
        lines += ["", f"torchpass / torchft: {t['torchpass_over_torchft']}", ""]
    lines += [
        "| system | fault | end | job time (s) | over no fault (s) | fault to next committed step (s) "
        "| back to 2 groups (s) | committed steps lost | steps with < 2 replicas | final loss "
        "| bitwise = no fault |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for system, cases in r["systems"].items():
        base = peers.job_seconds(cases["no_fault"])
        for case, run in cases.items():
            secs = peers.job_seconds(run)
            rec = ", ".join(peers._s(x) for x in run.get("recoveries_s") or []) or "-"
            full = ", ".join(peers._s(x) for x in run.get("full_strength_s") or []) or "-"
            lines.append(
                f"| {SYSTEM_LABELS[system]} | {CASE_LABELS[case]} | {run['state']} | {secs:.1f} | "
                f"{'-' if case == 'no_fault' else f'{secs - base:+.1f}'} | {rec} | {full} | "
                f"{run.get('lost_steps', '-')} | {run.get('fewer_replica_steps', '-')} | "
                f"{run.get('final_loss') or '-'} | "
                f"{'yes' if run['bitwise_equal_to_no_fault'] else 'no'} |"
            )
    return "\n".join(lines)


# --- the command ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    day = time.strftime("%Y-%m-%d", time.gmtime())
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.peers_hsdp", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--json",
        type=Path,
        default=RESULTS / f"peers-hsdp-{day}.json",
        help="write the results here (default benchmarks/results/peers-hsdp-<UTC date>.json)",
    )
    p.add_argument("--rounds", type=int, default=2, help="throughput rounds, alternated (default 2; 0: none)")
    p.add_argument(
        "--cases",
        default=",".join(CASES),
        help=f"fault cases, comma-separated, of {', '.join(CASES)} (default all; no_fault always runs)",
    )
    p.add_argument("--systems", default=",".join(SYSTEMS), help="systems to run (default both)")
    p.add_argument(
        "--steps",
        type=int,
        default=HsdpSizing.steps,
        help=f"steps of the fault runs (default {HsdpSizing.steps}; the fault at step 8)",
    )
    p.add_argument("--tables", action="store_true", help="only print the tables of --json")
    a = p.parse_args(argv)
    for name, valid in (("cases", CASES), ("systems", SYSTEMS)):
        values = [v for v in getattr(a, name).split(",") if v]
        unknown = sorted(set(values) - set(valid))
        if unknown:
            p.error(f"--{name}: unknown {', '.join(unknown)}; valid: {', '.join(valid)}")
        setattr(a, name, values)
    return a


def measure(a: argparse.Namespace, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    size = HsdpSizing(steps=a.steps, throughput_rounds=a.rounds)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count()},
        "slurm": jobs.on("ctl", "sinfo", "--version").strip(),
        "sizing": size.__dict__ | {"model": list(size.model), "kills_at": list(size.kills_at)},
        "train_args": size.train_args(size.steps, size.step_sleep, size.ckpt_every),
        "systems": {},
    }
    for system in a.systems:
        run_system(system, a.cases, size, result["systems"].setdefault(system, {}), lambda: save(result))
    if a.rounds and set(a.systems) == set(SYSTEMS):
        result["throughput"] = throughput(size)
    result["ended"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return result


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.tables:
        print(tables(json.loads(a.json.read_text())))
        return 0
    from scripts import devcluster

    if devcluster.FLAVOR.name != "bookworm":
        print(
            "benchmarks.peers_hsdp runs on the bookworm dev cluster (FSDP2 and torchft need torch 2.13): "
            "TP_CLUSTER_FLAVOR=bookworm python3 -m benchmarks.peers_hsdp",
            file=sys.stderr,
        )
        return 2

    def save(result: dict[str, Any]) -> None:
        manifest.write_result(a.json, result)

    cluster = jobs.CLUSTER
    started = not cluster.is_up()
    if started:
        cluster.up()
    try:
        result = measure(a, save)
    finally:
        if started:
            cluster.down()
    save(result)
    print(tables(result))
    jobs.progress(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
