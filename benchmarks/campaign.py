"""A fault campaign: N faults of six classes, drawn from a seeded generator, over as many jobs as needed.

    TP_CLUSTER_FLAVOR=bookworm scripts/bench --campaign 50 [--campaign-seed 14]
    TP_CLUSTER_FLAVOR=bookworm python3 -m benchmarks.campaign --faults 50 [--json F]

Every job is the example training under ``tp run`` (tp-submit -N 3 --spares 2, the quick
model, 30 steps, a checkpoint every 6) and takes as many faults as it has spares, each at a
drawn committed step in its own window of the run, on a drawn active node that is not the
batch host (the supervisor lives there: its loss is a restart by design, not a migration to
measure). The classes:

    node power-off      the node's container is killed
    rank SIGKILL        the training process is killed; its node stays up
    rank hang           SIGSTOP to the training process, SIGCONT 8 s later
    network partition   the node is cut off the cluster network, plugged back in 10 s later
    ECC warning         the node's simulated GPU reports 50,000 corrected ECC errors
    admin drain         ``scontrol update state=drain``

Between jobs the nodes are given back to Slurm as a site would: a powered-off node is
powered on, a cut one plugged in, a drained one resumed, a simulated GPU healthy again, so
the next job gets its spares again. A fault-free job of the same training comes first: its
final weights are the reference.

Each injected fault is matched with the fault ``tp report`` found on that node after it, and
counted: **live with no lost progress** (resolution ``live`` and 0 committed steps lost: the
YOCO share), **no data loss** (its job completed every step, so every sample was trained),
**bitwise equal** (its job's final weights equal the fault-free job's). Results go to JSON,
with the printout of ``tp report --totals-only`` over the campaign's run folders (one fleet
folder under /shared/bench).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import jobs, manifest
from benchmarks.runs import FAILING_ECC, HEALTHY_GPU
from scripts.devcluster import COMPUTE
from torchpass_slurm.analysis.report_totals import job_json
from torchpass_slurm.cli.report import load_report

CLASSES = ("node power-off", "rank SIGKILL", "rank hang", "network partition", "ECC warning", "admin drain")
TRAINING = "sbatch-examples/tiny_gpt.py"
#: Seconds between SIGSTOP and SIGCONT of a hung rank, and between a partition and its heal.
HANG_S = 8.0
PARTITION_S = 10.0
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "campaign.json"


@dataclass(frozen=True)
class CampaignSizing:
    steps: int = 30  # the second window (12-16) ends well before the last: a drain is seen seconds late
    step_sleep: float = 0.3
    ckpt_every: int = 6
    model: tuple[int, int] = (128, 2)
    spares: int = 2  # faults per job: one spare each
    first_step: int = 4  # the earliest fault step; each fault has a window of window steps
    window: int = 8

    def train_args(self) -> list[str]:
        d, layers = self.model
        return [
            "--d-model",
            str(d),
            "--n-layers",
            str(layers),
            "--steps",
            str(self.steps),
            "--ckpt-every",
            str(self.ckpt_every),
            "--step-sleep",
            str(self.step_sleep),
            "--log-every",
            "4",
        ]


@dataclass(frozen=True)
class PlannedFault:
    index: int
    fault_class: str
    step: int
    node_pick: int  # index into the job's candidate nodes (modulo their number)


def plan(faults: int, seed: int, size: CampaignSizing) -> list[list[PlannedFault]]:
    """The campaign's jobs: each a list of faults (class, step, node pick), from ``random.Random(seed)``."""
    rng = random.Random(seed)
    out: list[list[PlannedFault]] = []
    index = 0
    while index < faults:
        job = []
        for slot in range(min(size.spares, faults - index)):
            low = size.first_step + slot * size.window
            job.append(
                PlannedFault(
                    index, rng.choice(CLASSES), rng.randint(low, low + size.window - 4), rng.randrange(1000)
                )
            )
            index += 1
        out.append(job)
    return out


class Faults:
    """Injecting the six classes, and undoing them between jobs (what a site does to its nodes)."""

    def __init__(self, sim: Path) -> None:
        self.sim = sim
        self.timers: list[threading.Timer] = []

    def healthy_gpus(self) -> None:
        for node in COMPUTE:
            (self.sim / f"{node}.json").write_text(json.dumps({"gpus": [HEALTHY_GPU]}))

    def injector(self, fault: PlannedFault) -> jobs.Injector:
        def inject(job: jobs.Job) -> dict[str, Any]:
            candidates = candidates_of(job)
            node = candidates[fault.node_pick % len(candidates)]
            wall = time.time()
            kind = self.act(fault.fault_class, node)
            return {
                "kind": kind,
                "class": fault.fault_class,
                "node": node,
                "wall": wall,
                "index": fault.index,
            }

        return inject

    def act(self, fault_class: str, node: str) -> str:
        if fault_class == "node power-off":
            jobs.CLUSTER.kill(node)
            return "kill"
        if fault_class == "rank SIGKILL":
            jobs.on(node, "pkill", "-KILL", "-f", TRAINING, check=False)
            return "rank-kill"
        if fault_class == "rank hang":
            jobs.on(node, "pkill", "-STOP", "-f", TRAINING, check=False)
            self.later(HANG_S, lambda: jobs.on(node, "pkill", "-CONT", "-f", TRAINING, check=False))
            return "rank-stop"
        if fault_class == "network partition":
            jobs.CLUSTER.partition(node)
            self.later(PARTITION_S, lambda: jobs.CLUSTER.heal(node))
            return "partition"
        if fault_class == "ECC warning":
            gpu = {**HEALTHY_GPU, "ecc_corrected": FAILING_ECC}
            (self.sim / f"{node}.json").write_text(json.dumps({"gpus": [gpu]}))
            return "ecc"
        jobs.on("ctl", "scontrol", "update", f"nodename={node}", "state=drain", "reason=bench: maintenance")
        return "drain"

    def later(self, seconds: float, action: Callable[[], object]) -> None:
        def run() -> None:
            try:
                action()
            except Exception as err:  # a repair that failed here is done again between jobs
                jobs.progress(f"  a delayed repair failed: {err}")

        timer = threading.Timer(seconds, run)
        timer.daemon = True
        timer.start()
        self.timers.append(timer)

    def repair(self, job: jobs.Job) -> None:
        """Give every node back to Slurm: timers done, powered on, plugged in, GPUs healthy, resumed."""
        for timer in self.timers:
            timer.join(timeout=30)
        self.timers.clear()
        for fault in job.faults:
            node = fault["node"]
            if fault["kind"] == "kill":
                jobs.CLUSTER.restart(node)
            elif fault["kind"] == "partition" and not jobs.CLUSTER.attached(node):
                jobs.CLUSTER.heal(node)
            elif fault["kind"] == "rank-stop":
                jobs.on(node, "pkill", "-CONT", "-f", TRAINING, check=False)
        self.healthy_gpus()
        jobs.wait_idle()


def candidates_of(job: jobs.Job) -> list[str]:
    """The job's active nodes other than its batch host and the nodes this job's earlier faults hit
    (the supervisor may not have seen a drain yet: in the run of 2026-12-01 one node was drained
    twice, 4 s apart, and the second fault was no fault), in name order."""
    batch = jobs.CLUSTER.job_field(job.job_id, "BatchHost")
    hit = {f["node"] for f in job.faults}
    nodes = sorted(
        str(n["node"])
        for n in jobs.CLUSTER.tp_status(job.job_id).get("nodes", [])
        if n.get("role") == "active" and n.get("node") != batch and n.get("node") not in hit
    )
    if not nodes:
        raise jobs.BenchError(f"job {job.job_id} has no active node besides its batch host {batch}")
    return nodes


def submit(fleet: str, name: str, size: CampaignSizing, env: Mapping[str, str]) -> jobs.Job:
    folder = f"{fleet}/{name}"
    jobs.CLUSTER.host_path(folder).mkdir(parents=True, exist_ok=True)
    job_id = jobs.CLUSTER.tp_submit(
        folder, "-N", "3", "--spares", str(size.spares), jobs.TP_SCRIPT, *size.train_args(), env=env
    )
    return jobs.Job(job_id, folder, time.monotonic())


# --- judging ---------------------------------------------------------------------------------


def match(injected: Sequence[dict[str, Any]], found: Sequence[dict[str, Any]]) -> list[dict[str, Any] | None]:
    """For each injected fault, the first fault tp report found on its node after it (each used once)."""
    used: set[int] = set()
    out: list[dict[str, Any] | None] = []
    for fault in injected:
        pick = None
        for i, f in enumerate(found):
            after = float(f.get("time") or 0) >= fault["wall"] - 1
            if i not in used and f.get("node") == fault["node"] and after:
                pick = i
                break
        if pick is not None:
            used.add(pick)
        out.append(found[pick] if pick is not None else None)
    return out


def never_injected(job: jobs.Job, planned: Sequence[PlannedFault]) -> list[dict[str, Any]]:
    """One record per planned fault the job never took: it ended first."""
    return [
        {
            "index": p.index,
            "class": p.fault_class,
            "node": None,
            "at_step": p.step,
            "job": job.job_id,
            "folder": job.folder,
            "job_state": job.state,
            "resolution": None,
            "lost_steps": None,
            "live_no_lost_progress": False,
            "no_data_loss": False,
            "bitwise_equal": False,
            "phases": None,
            "cause": f"never injected: the job ended {job.state} before step {p.step}",
        }
        for p in planned[len(job.faults) :]
    ]


def run_and_save(run: Callable[[], dict[str, Any]], path: Path) -> dict[str, Any]:
    """``run()`` on the cluster (started and taken down again if it was not up), its result
    dated and written to ``path``."""
    cluster = jobs.CLUSTER
    started = not cluster.is_up()
    if started:
        cluster.up()
    try:
        result = run()
    finally:
        if started:
            cluster.down()
    result["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    manifest.write_result(path, result)
    return result


def judge(job: jobs.Job, reference: str | None, steps: int) -> list[dict[str, Any]]:
    """One record per injected fault of a finished job."""
    report = job_json(load_report(jobs.CLUSTER.host_path(job.folder)))
    found = report.get("faults", [])
    done = jobs.DONE_LINE.search(job.output())
    completed = job.state == "COMPLETED" and done is not None and int(done.group(1)) == steps
    bitwise = completed and done is not None and done.group(3) == reference
    records = []
    for fault, seen in zip(job.faults, match(job.faults, found), strict=True):
        resolution = seen.get("resolution") if seen else None
        lost = seen.get("lost_steps") if seen else None
        live = resolution == "live" and lost == 0
        cause = None
        if not live:
            cause = (
                "tp report found no fault on the node after the injection"
                if seen is None
                else f"resolution {resolution}, {lost} committed steps lost"
                + (f", fallback: {seen.get('fallback')}" if seen.get("fallback") else "")
                + f" (detector {seen.get('detector')}, {seen.get('detail')})"
            )
        elif not bitwise:
            cause = (
                "final weights differ from the fault-free job's" if completed else f"job ended {job.state}"
            )
        records.append(
            {
                "index": fault["index"],
                "class": fault["class"],
                "node": fault["node"],
                "at_step": fault["at_step"],
                "job": job.job_id,
                "folder": job.folder,
                "job_state": job.state,
                "resolution": resolution,
                "lost_steps": lost,
                "report_class": seen.get("class") if seen else None,
                "live_no_lost_progress": live,
                "no_data_loss": completed,
                "bitwise_equal": bitwise,
                "cause": cause,
                "phases": seen.get("phases") if seen else None,
            }
        )
    return records


def totals(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per class and over all: faults, and the three shares."""

    def one(rs: Sequence[dict[str, Any]]) -> dict[str, Any]:
        n = len(rs)
        live = [r for r in rs if r["live_no_lost_progress"]]
        return {
            "faults": n,
            "live_no_lost_progress": len(live),
            "no_data_loss": sum(r["no_data_loss"] for r in rs),
            "bitwise_equal_among_live": sum(r["bitwise_equal"] for r in live),
            "share_live": round(len(live) / n, 4) if n else None,
            "share_no_data_loss": round(sum(r["no_data_loss"] for r in rs) / n, 4) if n else None,
            "share_bitwise_among_live": round(sum(r["bitwise_equal"] for r in live) / len(live), 4)
            if live
            else None,
        }

    by_class = {c: one([r for r in records if r["class"] == c]) for c in CLASSES}
    return {"by_class": {c: t for c, t in by_class.items() if t["faults"]}, "all": one(records)}


def table(result: Mapping[str, Any]) -> str:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.0f} %"

    t = result["totals"]
    lines = [
        "| fault class | faults | live, no lost progress (YOCO) | no data loss "
        "| bitwise equal (of the live) |",
        "|---|---|---|---|---|",
    ]
    for name, c in [*t["by_class"].items(), ("**all**", t["all"])]:
        lines.append(
            f"| {name} | {c['faults']} | {c['live_no_lost_progress']} ({pct(c['share_live'])}) | "
            f"{c['no_data_loss']} ({pct(c['share_no_data_loss'])}) | "
            f"{c['bitwise_equal_among_live']} ({pct(c['share_bitwise_among_live'])}) |"
        )
    short = [r for r in result["faults"] if r["cause"]]
    if short:
        lines += ["", "Faults that fell short:", ""]
        lines += [
            f"- fault {r['index']} ({r['class']} of {r['node']} at step {r['at_step']}, "
            f"job {r['job']}): "
            f"{r['cause']}"
            for r in short
        ]
    return "\n".join(lines)


# --- the campaign -----------------------------------------------------------------------------


def campaign(faults: int = 50, seed: int = 14, size: CampaignSizing | None = None) -> dict[str, Any]:
    size = size or CampaignSizing()
    tag = uuid.uuid4().hex[:8]
    fleet = f"/shared/bench/campaign-{tag}"
    sim = jobs.CLUSTER.shared_host / "health" / f"campaign-{tag}"
    sim.mkdir(parents=True, exist_ok=True)
    (sim / "health.toml").write_text('disk_paths = ["/shared"]\necc_rate_min_interval_s = 1.0\n')
    env = {
        "TORCHPASS_HEALTH_SIMULATE": f"/shared/health/campaign-{tag}/{{node}}.json",
        "TORCHPASS_HEALTH_CONFIG": f"/shared/health/campaign-{tag}/health.toml",
        "TORCHPASS_HEALTH_INTERVAL": "1",
    }
    inject = Faults(sim)
    inject.healthy_gpus()
    schedule = plan(faults, seed, size)
    began = time.monotonic()
    jobs.wait_idle()
    jobs.progress(
        f"campaign: {faults} faults over {len(schedule)} jobs (seed {seed}); the fault-free job first"
    )
    ref_job = jobs.run(submit(fleet, "job-00-no-fault", size, env), jobs.tp_progress)
    ref = jobs.DONE_LINE.search(ref_job.output())
    reference = ref.group(3) if ref and ref_job.state == "COMPLETED" else None
    records: list[dict[str, Any]] = []
    job_rows: list[dict[str, Any]] = []
    for number, planned in enumerate(schedule, start=1):
        jobs.progress(
            f"campaign: job {number}/{len(schedule)}: "
            + ", ".join(f"{p.fault_class} at step {p.step}" for p in planned)
        )
        job = submit(fleet, f"job-{number:02d}", size, env)
        try:
            jobs.run(job, jobs.tp_progress, [(p.step, inject.injector(p)) for p in planned])
        except jobs.BenchError as err:
            jobs.progress(f"  {err}")
            job.ended = job.ended or time.monotonic()
        records.extend(never_injected(job, planned))
        records.extend(judge(job, reference, size.steps))
        job_rows.append(
            {
                "job": job.job_id,
                "folder": job.folder,
                "state": job.state,
                "seconds": round(job.seconds, 2),
                "faults": job.faults,
            }
        )
        shown = records[-len(planned) :]
        jobs.progress(
            "  "
            + "; ".join(
                f"{r['class']}: {r['resolution']}, lost {r['lost_steps']}, bitwise {r['bitwise_equal']}"
                for r in shown
            )
        )
        inject.repair(job)
    records.sort(key=lambda r: r["index"])
    totals_out = jobs.on("ctl", "tp", "report", "--totals-only", fleet, check=False)
    return {
        "faults_asked": faults,
        "seed": seed,
        "sizing": {**size.__dict__, "model": list(size.model)},
        "train_args": size.train_args(),
        "fleet": fleet,
        "reference_job": ref_job.job_id,
        "reference_params_sha256": reference,
        "seconds": round(time.monotonic() - began, 1),
        "jobs": job_rows,
        "faults": records,
        "totals": totals(records),
        "tp_report_totals_only": totals_out,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.campaign", description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", type=int, default=50, help="faults to inject (default 50)")
    p.add_argument("--seed", type=int, default=14, help="seed of the fault generator (default 14)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"results file (default {DEFAULT_JSON})")
    a = p.parse_args(argv)
    result = run_and_save(lambda: campaign(a.faults, a.seed), a.json)
    print(table(result))
    print(result["tp_report_totals_only"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
