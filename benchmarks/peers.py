"""torchpass against its peers on one cluster, in one run: torchft, checkpoint restart, requeue.

    TP_CLUSTER_FLAVOR=bookworm scripts/bench --only peers     (part of the suite)
    TP_CLUSTER_FLAVOR=bookworm python3 -m benchmarks.peers [--json F]

Four systems train the same model on the same data with the same seed and step count on
the same 3 active nodes, with 2 spare nodes in the allocation:

    torchpass  tp-submit -N 3 --spares 2 (live migration onto hot spares)
    restart    the same with TORCHPASS_RECOVERY=restart (every rank restarts from the newest
               checkpoint in the allocation, on a spare for a lost node)
    requeue    sbatch --requeue -N 3 of the plain DDP training, resuming from its checkpoint
    torchft    sbatch -N 5 benchmarks/peer_drivers/tiny_gpt_torchft.sbatch: torchft 0.2.0's Lighthouse,
               one replica group per node, a failed group restarted on its node or a spare
    torchft-fixed  the same with its DDP comm hook's error path fixed (TORCHFT_DDP_HOOK=fixed:
               0.2.0's hook asserts after a failed allreduce and kills the surviving groups)

and each meets the same faults at the same committed steps: a node powered off (two of
them, the completion run), a rank process SIGKILLed, and an admin drain, next to a fault-free
run of its own. Measured per run: job time (first start to end), the time from each fault to
the next committed step, committed steps lost (a restart's rollback), steps trained by fewer
than 3 replicas (torchft goes on without the lost group: that group's samples of those steps
are never trained), final loss, and whether the final weights equal the system's fault-free
run bit for bit. Then steady-state throughput, no fault and no sleep, of plain DDP,
torchpass and torchft, alternated. Needs the bookworm flavor: torchft needs torch >= 2.7.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import jobs, manifest
from torchpass_slurm.analysis.report_totals import job_json
from torchpass_slurm.cli.report import load_report
from torchpass_slurm.rundir import events as ev

TORCHFT_SCRIPT = "/src/benchmarks/peer_drivers/tiny_gpt_torchft.sbatch"
SYSTEMS = ("torchft", "torchft-fixed", "torchpass", "restart", "requeue")
SYSTEM_LABELS = {
    "torchpass": "torchpass (live migration)",
    "torchft": "torchft 0.2.0",
    "torchft-fixed": "torchft 0.2.0, comm hook fixed",
    "restart": "checkpoint restart in the allocation (tp run)",
    "requeue": "sbatch --requeue (plain DDP)",
}
CASES = ("no_fault", "node_kill", "rank_kill", "drain")
CASE_LABELS = {
    "no_fault": "no fault",
    "node_kill": "2 nodes powered off",
    "rank_kill": "rank process SIGKILLed",
    "drain": "admin drain",
}
PATTERNS = {"torchft": "tiny_gpt_torchft.py", "torchft-fixed": "tiny_gpt_torchft.py"}
TRAINING = "sbatch-examples/tiny_gpt.py"


@dataclass(frozen=True)
class PeerSizing:
    """The runs: the suite's quick model, short jobs, the faults at fixed committed steps."""

    steps: int = 24
    step_sleep: float = 0.3
    ckpt_every: int = 6
    model: tuple[int, int] = (128, 2)
    fault_at: int = 8
    kills_at: tuple[int, int] = (8, 16)
    spares: int = 2
    throughput_steps: int = 60
    throughput_rounds: int = 2

    def train_args(self, steps: int, sleep: float, ckpt_every: int) -> list[str]:
        d, layers = self.model
        return [
            "--d-model",
            str(d),
            "--n-layers",
            str(layers),
            "--steps",
            str(steps),
            "--ckpt-every",
            str(ckpt_every),
            "--step-sleep",
            str(sleep),
            "--log-every",
            "1",
        ]


# --- submitting, watching -------------------------------------------------------------


def submit(system: str, args: list[str], spares: int) -> jobs.Job:
    if system == "torchpass":
        return jobs.submit_tp(args, spares=spares)
    if system == "restart":
        return jobs.submit_tp(args, spares=spares, env={"TORCHPASS_RECOVERY": "restart"})
    if system == "requeue":
        return jobs.submit_plain(args, requeue=True)
    if system == "plain":
        return jobs.submit_plain(args)
    folder = jobs.new_folder("torchft")
    hook = "fixed" if system == "torchft-fixed" else "shipped"
    job_id = jobs.CLUSTER.sbatch(
        "-N",
        str(3 + spares),
        "--no-kill",
        "--output",
        f"{folder}/slurm-%j.out",
        f"--export=ALL,TORCHFT_LOG_DIR={folder},TORCHFT_DDP_HOOK={hook}",
        "--chdir",
        folder,
        TORCHFT_SCRIPT,
        *args,
    )
    return jobs.Job(job_id, folder, time.monotonic())


def torchft_records(job: jobs.Job) -> list[dict[str, Any]]:
    """Every group's commit log, merged in time order."""
    out: list[dict[str, Any]] = []
    for path in sorted(jobs.CLUSTER.host_path(job.folder).glob("torchft-g*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line being written
    return sorted(out, key=lambda r: r["t"])


def torchft_progress(job: jobs.Job) -> int:
    steps = [r["step"] for r in torchft_records(job) if "quorum" in r and "event" not in r]
    return max(steps) if steps else 0


def torchft_victim(job: jobs.Job) -> str:
    """The node of the highest replica group that is not on the batch host (the Lighthouse's)
    nor on a node this run already powered off."""
    latest: dict[int, str] = {}
    for r in torchft_records(job):
        if r.get("event") == "start":
            latest[r["group"]] = r["node"]
    gone = {f["node"] for f in job.faults if f["kind"] == "kill"} | {
        jobs.CLUSTER.job_field(job.job_id, "BatchHost")
    }
    nodes = [node for _, node in sorted(latest.items()) if node not in gone]
    if not nodes:
        raise jobs.BenchError(f"torchft job {job.job_id} has no group outside its batch host yet")
    return nodes[-1]


PROGRESS: dict[str, Callable[[jobs.Job], int]] = {
    "torchpass": jobs.tp_progress,
    "restart": jobs.tp_progress,
    "requeue": jobs.plain_progress,
    "plain": jobs.plain_progress,
    "torchft": torchft_progress,
    "torchft-fixed": torchft_progress,
}
VICTIM: dict[str, Callable[[jobs.Job], str]] = {
    "torchpass": jobs.tp_victim,
    "restart": jobs.tp_victim,
    "requeue": jobs.plain_victim,
    "torchft": torchft_victim,
    "torchft-fixed": torchft_victim,
}


class StepClock:
    """When each new committed step was first seen (wall clock): the requeue run's only timing."""

    def __init__(self, progress: Callable[[jobs.Job], int]) -> None:
        self.progress, self.last, self.seen = progress, -1, []

    def __call__(self, job: jobs.Job) -> int:
        step = self.progress(job)
        if step != self.last:
            self.seen.append((time.time(), step))
            self.last = step
        return step


def injector(kind: str, system: str) -> jobs.Injector:
    def inject(job: jobs.Job) -> dict[str, Any]:
        node, wall = VICTIM[system](job), time.time()
        if kind == "kill":
            jobs.CLUSTER.kill(node)
        elif kind == "drain":
            jobs.on(
                "ctl", "scontrol", "update", f"nodename={node}", "state=drain", "reason=bench: maintenance"
            )
        else:
            jobs.on(node, "pkill", "-KILL", "-f", PATTERNS.get(system, TRAINING), check=False)
        return {"kind": kind, "node": node, "wall": wall}

    return inject


# --- one run's numbers -------------------------------------------------------------------


def run_case(system: str, case: str, size: PeerSizing) -> dict[str, Any]:
    args = size.train_args(size.steps, size.step_sleep, size.ckpt_every)
    plan: list[tuple[int, jobs.Injector]] = {
        "no_fault": [],
        "node_kill": [(at, injector("kill", system)) for at in size.kills_at],
        "rank_kill": [(size.fault_at, injector("rank-kill", system))],
        "drain": [(size.fault_at, injector("drain", system))],
    }[case]
    jobs.wait_idle()
    jobs.progress(f"peers: {system}, {CASE_LABELS[case]}")
    clock = StepClock(PROGRESS[system])
    job = submit(system, args, size.spares)
    try:
        jobs.run(job, clock, plan)
    except jobs.BenchError as err:  # a system that does not survive a fault is a result
        jobs.progress(f"  {err}")
        job.ended = job.ended or time.monotonic()
    end_wall = time.time() - (time.monotonic() - (job.ended or time.monotonic()))
    out: dict[str, Any] = {
        "job": job.job_id,
        "state": job.state,
        "folder": job.folder,
        "seconds": round(job.seconds, 2),
        "timeline": job.timeline,
        "injected": job.faults,
        **outcome(system, job, clock, size),
    }
    if case == "drain" and job.faults:
        out["drained_node_held_s"] = held(system, job, end_wall)
    jobs.restart_nodes([f["node"] for f in job.faults if f["kind"] == "kill"])
    return out


def held(system: str, job: jobs.Job, end_wall: float) -> float:
    """Seconds the drained node stayed in the job: until the migration off it was done (tp run),
    else until the job ended (torchft and requeue have no notion of a drain)."""
    wall = job.faults[0]["wall"]
    if system in ("torchpass", "restart"):
        events = ev.read_events(job.event_log())
        done = next((e.ts for e in events if e.kind == ev.MIGRATION_DONE and e.ts > wall), None)
        if done is not None:
            return round(done - wall, 2)
    return round(end_wall - wall, 2)


def outcome(system: str, job: jobs.Job, clock: StepClock, size: PeerSizing) -> dict[str, Any]:
    walls = [f["wall"] for f in job.faults]
    if system.startswith("torchft"):
        return torchft_outcome(job, walls, size)
    text = job.output()
    done = jobs.DONE_LINE.search(text)
    result: dict[str, Any] = {
        "final_loss": done.group(2) if done else None,
        "params_sha256": done.group(3) if done else None,
        "fewer_replica_steps": 0,
    }
    if system == "requeue":
        starts = [int(s) for s in jobs.START_LINE.findall(text)]
        computed = sum(1 for _ in jobs.STEP_LINE.finditer(text))
        result.update(
            recoveries_s=requeue_recoveries({"injected": job.faults, "timeline": job.timeline}),
            starts_at_steps=starts,
            lost_steps=max(0, computed - size.steps) if done else None,
            resolutions=["requeue" if len(starts) > 1 else "-"] * len(walls),
        )
        return result
    report = job_json(load_report(jobs.CLUSTER.host_path(job.folder)))
    faults = report.get("faults", [])
    result.update(
        recoveries_s=tp_recoveries(job, walls),
        lost_steps=sum(int(f.get("lost_steps") or 0) for f in faults),
        resolutions=[f.get("resolution") for f in faults],
        report_faults=faults,
    )
    return result


def requeue_recoveries(run: Mapping[str, Any]) -> list[float | None]:
    """From each fault until Slurm runs the requeued job again (the job's state timeline, polled
    twice a second); its first step comes after the start-up and the steps since its checkpoint."""
    out: list[float | None] = []
    for fault in run["injected"]:
        at, left = fault["at_seconds"], False
        back = None
        for t, state in run["timeline"]:
            if t <= at:
                continue
            left = left or state != "RUNNING"
            if left and state == "RUNNING":
                back = round(t - at, 2)
                break
        out.append(back)
    return out


def tp_recoveries(job: jobs.Job, walls: Sequence[float]) -> list[float | None]:
    """From each fault to the first committed step after it (``first_step``); a checkpoint
    restart logs none: there, to the ranks resumed from the checkpoint (``migration_done``),
    one step short of the first step."""
    events = ev.read_events(job.event_log())
    marks = [
        (e.ts, 0)
        for e in events
        if e.kind == ev.FIRST_STEP
        or (e.kind == ev.MIGRATION_DONE and e.fields.get("resolution") == "checkpoint")
    ]
    return [_after(marks, w, lambda s: True) for w in walls]


def _after(seen: Sequence[tuple[float, int]], wall: float, ok: Callable[[int], bool]) -> float | None:
    t = next((t for t, s in seen if t > wall and ok(s)), None)
    return None if t is None else round(t - wall, 2)


def rolled_back(commits: Sequence[Mapping[str, Any]]) -> int:
    """Committed steps thrown away: a group that starts again with no healthy group to heal from
    trains from step 0, and the steps committed before are lost. (The groups log the same step
    a moment apart, so a drop of one step is skew, not a rollback.)"""
    lost, high = 0, 0
    for c in commits:
        if c["step"] < high - 1:
            lost += high - (c["step"] - 1)
            high = c["step"]
        high = max(high, c["step"])
    return lost


def reanalyse(result: dict[str, Any]) -> None:
    """Recompute the recoveries from the run folders and injected faults (a rule changed)."""
    size = PeerSizing(**{k: tuple(v) if isinstance(v, list) else v for k, v in result["sizing"].items()})
    for system, cases in result["systems"].items():
        for run in cases.values():
            job = jobs.Job(run["job"], run["folder"], 0.0)
            job.faults = run["injected"]
            walls = [f["wall"] for f in job.faults]
            if system.startswith("torchft"):
                run.update(torchft_outcome(job, walls, size))
            elif system == "requeue":
                run["recoveries_s"] = requeue_recoveries(run)
            else:
                run["recoveries_s"] = tp_recoveries(job, walls)
            ref = cases["no_fault"]["params_sha256"]
            run["bitwise_equal_to_no_fault"] = bool(ref) and run["params_sha256"] == ref


def torchft_outcome(job: jobs.Job, walls: list[float], size: PeerSizing, replicas: int = 3) -> dict[str, Any]:
    """The torchft run's numbers from its commit logs; ``replicas``: its replica groups."""
    records = torchft_records(job)
    commits = [r for r in records if "quorum" in r and "event" not in r]
    dones = [r for r in records if "done" in r]
    recov, full = [], []
    for wall in walls:
        before = [c for c in commits if c["t"] <= wall]
        quorum = before[-1]["quorum"] if before else None
        after = [c for c in commits if c["t"] > wall]
        changed = [c for c in after if c["quorum"] != quorum] or after
        recov.append(round(changed[0]["t"] - wall, 2) if changed else None)
        short = [c for c in after if c["participants"] < replicas]
        back = [c for c in after if short and c["t"] > short[0]["t"] and c["participants"] >= replicas]
        full.append(round(back[0]["t"] - wall, 2) if back else None)
    by_step: dict[int, int] = {}  # the last commit of each step: the final weights' history
    for c in commits:
        by_step[c["step"]] = c["participants"]
    hashes = {d["params_sha256"] for d in dones}
    losses = [d["loss"] for d in dones]
    restarts = [r for r in records if r.get("event") == "start" and r.get("restart", 0) > 0]
    return {
        "recoveries_s": recov,
        "full_strength_s": full,
        "lost_steps": rolled_back(commits),
        "fewer_replica_steps": sum(1 for p in by_step.values() if p < replicas),
        "final_loss": f"{statistics.fmean(losses):.4f}" if losses else None,
        "params_sha256": hashes.pop() if len(hashes) == 1 else (None if not hashes else "differ"),
        "groups_done": len(dones),
        "group_restarts": [(r["group"], r["node"]) for r in restarts],
        "resolutions": ["group restarted" if restarts else "none"] * len(walls),
    }


# --- throughput --------------------------------------------------------------------------------


def throughput(size: PeerSizing) -> dict[str, Any]:
    args = size.train_args(size.throughput_steps, 0.0, 0)
    runs: dict[str, list[float]] = {"plain": [], "torchpass": [], "torchft": []}
    for i in range(size.throughput_rounds):
        for system in runs:
            jobs.wait_idle()
            jobs.progress(f"peers: throughput, {system} (round {i + 1})")
            job = jobs.run(submit(system, args, size.spares), PROGRESS[system])
            line = jobs.THROUGHPUT_LINE.search(job.output())
            if not line:
                raise jobs.BenchError(
                    f"{system} job {job.job_id} ended {job.state} without a throughput line"
                )
            runs[system].append(float(line.group(3)))
    median = {s: statistics.median(v) for s, v in runs.items()}
    return {
        "train_args": args,
        "runs": runs,
        "median_tokens_per_s": median,
        "against_plain": {s: round(median[s] / median["plain"], 3) for s in runs},
    }


def peers(
    size: PeerSizing | None = None, save: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    size = size or PeerSizing()
    sizing = size.__dict__ | {"model": list(size.model), "kills_at": list(size.kills_at)}
    out: dict[str, Any] = {
        "sizing": sizing,
        "train_args": size.train_args(size.steps, size.step_sleep, size.ckpt_every),
        "systems": {},
    }
    for system in SYSTEMS:
        out["systems"][system] = run_system(system, size, lambda: save(out) if save else None)
    out["throughput"] = throughput(size)
    return out


def run_system(system: str, size: PeerSizing, saved: Callable[[], object]) -> dict[str, Any]:
    """Every case of one system, its fault-free run first (the bitwise reference)."""
    runs: dict[str, Any] = {}
    for case in CASES:
        run = runs[case] = run_case(system, case, size)
        ref = runs["no_fault"]["params_sha256"]
        run["bitwise_equal_to_no_fault"] = bool(ref) and run["params_sha256"] == ref
        run["measured_at"] = time.strftime("%H:%M:%SZ", time.gmtime())
        saved()  # a crash later keeps what was measured
    return runs


# --- tables -----------------------------------------------------------------------------------


def _s(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def job_seconds(run: dict[str, Any]) -> float:
    started = next((t for t, state in run["timeline"] if state == "RUNNING"), 0.0)
    return float(run["seconds"]) - started


def tables(r: dict[str, Any]) -> str:
    t = r["throughput"]
    lines = ["| system | tokens/s | against plain DDP |", "|---|---|---|"]
    for s, v in t["median_tokens_per_s"].items():
        lines.append(f"| {s} | {v:.0f} | {100 * t['against_plain'][s]:.1f} % |")
    lines += [
        "",
        "| system | fault | end | job time (s) | over no fault (s) "
        "| fault to next committed step (s) | committed steps lost | steps with < 3 replicas "
        "| final loss | bitwise = no fault |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for system, cases in r["systems"].items():
        base = job_seconds(cases["no_fault"])
        for case, run in cases.items():
            secs = job_seconds(run)
            rec = ", ".join(_s(x) for x in run.get("recoveries_s") or []) or "-"
            if "drained_node_held_s" in run:
                rec += f" (node held {run['drained_node_held_s']:.1f} s)"
            lines.append(
                f"| {SYSTEM_LABELS[system]} | {CASE_LABELS[case]} | {run['state']} | {secs:.1f} | "
                f"{'-' if case == 'no_fault' else f'{secs - base:+.1f}'} | {rec} | "
                f"{run.get('lost_steps', '-')} | {run.get('fewer_replica_steps', '-')} | "
                f"{run.get('final_loss') or '-'} | "
                f"{'yes' if run['bitwise_equal_to_no_fault'] else 'no'} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "results" / "peers.json")
    p.add_argument("--rounds", type=int, default=2, help="throughput rounds, alternated (default 2)")
    p.add_argument(
        "--reanalyse",
        action="store_true",
        help="only recompute the torchft rows of --json from their run folders, and print",
    )
    p.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help="systems to run (default all); with fewer, the others' runs in --json are kept "
        "and no throughput is measured",
    )
    a = p.parse_args(argv)
    if a.reanalyse:
        result = json.loads(a.json.read_text())
        reanalyse(result)
        a.json.write_text(json.dumps(result, indent=1) + "\n")
        print(tables(result))
        return 0
    cluster = jobs.CLUSTER
    started = not cluster.is_up()
    if started:
        cluster.up()
    try:

        def save(result: dict[str, Any]) -> None:
            manifest.write_result(a.json, result)

        systems = tuple(s for s in a.systems.split(",") if s)
        if set(systems) == set(SYSTEMS):
            result = peers(PeerSizing(throughput_rounds=a.rounds), save)
        else:
            result = json.loads(a.json.read_text())
            for system in systems:
                result["systems"][system] = run_system(system, PeerSizing(), lambda: save(result))
        result["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    finally:
        if started:
            cluster.down()
    save(result)
    print(tables(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
