"""Long-life jobs: K faults in one job on one spare, the spare pool refilled between them.

    scripts/bench --campaign 12 --faults-per-job 12 [--campaign-seed 14]
    python3 -m benchmarks.long_life --faults 12 --faults-per-job 12 [--seed 14] [--json F]

A job reserves far fewer spares than it sees faults in its life; what keeps it live is the
pool refilling (``supervisor/refill.py``). Each job here (tp-submit -N 3 --spares 1, the
campaign's quick model, a checkpoint every 6 steps) takes K faults in a row, each drawn in its
own window of steps and injected once its pool is whole again (a spare on standby), so every
fault after the first is carried by a refill: the idle node, a node a site repaired, or a node
that lost only its process. The classes are the four whose node can come back while the job
runs, each repaired as a site would:

    node power-off      the container is killed, and powered on again 5 s later
    rank SIGKILL        the training process is killed; its node stays up
    rank hang           SIGSTOP to the training process, SIGCONT 8 s later
    network partition   cut off the network for 10 s, then plugged in and rebooted

The planned classes (ECC warning, admin drain) send their node to maintenance: it leaves the
job for good, and the 5-node dev cluster has no node to spare for that K times. They stay in
the one-fault-per-spare campaign (``benchmarks/campaign.py``), as do its judging rules, used
here unchanged: per fault, live with no lost progress, no data loss, bitwise equal.

Per refill, the seconds from a spare used (``spare_promoted``) to its replacement ready (the
next spare's standby ``worker_up``), by mechanism: the idle node (job expansion), a repaired
node (job expansion, once its slurmd restarted), a node given back (its process died, the node
did not).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import campaign, jobs
from torchpass_slurm.rundir import events as ev

CLASSES = ("node power-off", "rank SIGKILL", "rank hang", "network partition")
#: Seconds from a power cut to the node powered on again (its move is done by then).
REPAIR_S = 5.0
#: How long a fault waits for its job's pool to be whole before it is injected anyway.
POOL_WAIT_S = 180.0
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "long-life.json"


def sizing(per_job: int) -> campaign.CampaignSizing:
    """One spare, K windows of 8 steps, and room after them for a late fault."""
    first, window = 4, 8
    return campaign.CampaignSizing(
        steps=first + per_job * window + 30,
        step_sleep=0.5,
        ckpt_every=6,
        spares=1,
        first_step=first,
        window=window,
    )


def plan(
    faults: int, per_job: int, seed: int, size: campaign.CampaignSizing
) -> list[list[campaign.PlannedFault]]:
    """Jobs of ``per_job`` faults (the last may have fewer), from ``random.Random(seed)``."""
    rng = random.Random(seed)
    out: list[list[campaign.PlannedFault]] = []
    for index in range(faults):
        if index % per_job == 0:
            out.append([])
        low = size.first_step + (index % per_job) * size.window
        out[-1].append(
            campaign.PlannedFault(
                index, rng.choice(CLASSES), rng.randint(low, low + size.window - 4), rng.randrange(1000)
            )
        )
    return out


class RepairingFaults(campaign.Faults):
    """The campaign's faults, with the node given back to Slurm while the job runs."""

    def act(self, fault_class: str, node: str) -> str:
        kind = super().act(fault_class, node)
        if kind == "kill":
            self.later(REPAIR_S, lambda: jobs.CLUSTER.restart(node))
        elif kind == "partition":
            self.timers.pop().cancel()  # the campaign's heal alone: replaced by heal and reboot
            self.later(campaign.PARTITION_S, lambda: (jobs.CLUSTER.heal(node), jobs.CLUSTER.restart(node)))
        return kind

    def injector(self, fault: campaign.PlannedFault) -> jobs.Injector:
        def inject(job: jobs.Job) -> dict[str, Any]:
            began = time.monotonic()
            whole = wait_whole(job)
            epoch = settled(job)[1]
            nodes = candidates(job)
            node = nodes[fault.node_pick % len(nodes)]
            wall = time.time()
            kind = self.act(fault.fault_class, node)
            return {
                "kind": kind,
                "class": fault.fault_class,
                "node": node,
                "wall": wall,
                "index": fault.index,
                "pool_whole": whole,
                "epoch": epoch,
                "pool_wait_s": round(time.monotonic() - began, 1),
            }

        return inject


def settled(job: jobs.Job) -> tuple[bool, int]:
    """Whether the job runs with no recovery in flight and a spare on standby, and its epoch."""
    status = jobs.CLUSTER.tp_status(job.job_id)
    standby = [n for n in status.get("nodes", []) if n.get("role") == "spare" and n.get("state") == "standby"]
    return status.get("state") == "running" and bool(standby), int(status.get("epoch", 0))


def wait_whole(job: jobs.Job) -> bool:
    """Wait (at most POOL_WAIT_S) until the last fault's recovery is over (a later epoch, no
    recovery in flight) and the pool is whole (a spare on standby); whether it came to that.
    status.json is rewritten every second or so: a spare it still shows on standby may have
    been promoted already, so the epoch must have moved on too."""
    after = job.faults[-1].get("epoch", -1) if job.faults else -1
    deadline = time.monotonic() + POOL_WAIT_S
    while time.monotonic() < deadline:
        if jobs.job_state(job) in jobs.FINAL_STATES:
            return False
        whole, epoch = settled(job)
        if whole and epoch > after:
            return True
        time.sleep(jobs.POLL_S)
    return False


def candidates(job: jobs.Job) -> list[str]:
    """The job's active nodes but its batch host and the last fault's node, in name order."""
    batch = jobs.CLUSTER.job_field(job.job_id, "BatchHost")
    last = job.faults[-1]["node"] if job.faults else None
    nodes = sorted(
        str(n["node"])
        for n in jobs.CLUSTER.tp_status(job.job_id).get("nodes", [])
        if n.get("role") == "active" and n.get("node") not in (batch, last)
    )
    if not nodes:
        raise jobs.BenchError(f"job {job.job_id} has no active node besides its batch host {batch}")
    return nodes


def refills(events: Sequence[ev.Event], hit: Sequence[tuple[str, str, float]]) -> list[dict[str, Any]]:
    """Each spare used, and the seconds to its replacement's standby, by mechanism (module doc);
    ``hit``: (node, fault kind, unix time) of each fault: a node the job lost to a power-off or a
    partition comes back repaired (rebooted); one lost to a frozen or killed process without
    its slurmd restarting comes back once its slurmd answers the pool's probe, or 3 x
    SlurmdTimeout after its loss (``supervisor/refill.py``)."""
    out: list[dict[str, Any]] = []
    added: dict[str, ev.Event] = {}
    used: list[ev.Event] = []
    for e in events:
        node = str(e.fields.get("node", ""))
        if e.kind == ev.SPARE_PROMOTED and not e.fields.get("in_place"):  # in place: no spare used
            used.append(e)
        elif e.kind == ev.SPARE_ADDED:
            added[node] = e
        elif e.kind == ev.WORKER_UP and e.fields.get("role") == "spare" and node in added and used:
            joined = added.pop(node)
            promoted = used.pop(0)
            before = [kind for n, kind, at in hit if n == node and at < joined.ts]
            if joined.fields.get("returned"):
                mechanism = "given back"
            elif not before:
                mechanism = "idle node"
            elif before[-1] in ("kill", "partition"):
                mechanism = "repaired node"
            else:
                mechanism = "lost node, slurmd not restarted"
            out.append(
                {
                    "used": str(promoted.fields.get("node")),
                    "replacement": node,
                    "mechanism": mechanism,
                    "seconds": round(e.ts - promoted.ts, 2),
                    "slurm_s": joined.fields.get("seconds"),
                }
            )
    return out


def run_job(
    fleet: str,
    number: int,
    planned: Sequence[campaign.PlannedFault],
    size: campaign.CampaignSizing,
    inject: RepairingFaults,
    env: dict[str, str],
) -> jobs.Job:
    job = campaign.submit(fleet, f"job-{number:02d}", size, env)
    try:
        jobs.run(job, jobs.tp_progress, [(p.step, inject.injector(p)) for p in planned], timeout=1800)
    except jobs.BenchError as err:
        jobs.progress(f"  {err}")
        job.ended = job.ended or time.monotonic()
    return job


def long_life(
    faults: int, per_job: int, seed: int = 14, progress: Callable[[str], None] = jobs.progress
) -> dict[str, Any]:
    """Run the campaign (module doc); its JSON document."""
    size = sizing(per_job)
    tag = uuid.uuid4().hex[:8]
    fleet = f"/shared/bench/long-life-{tag}"
    sim = jobs.CLUSTER.shared_host / "health" / f"long-life-{tag}"
    sim.mkdir(parents=True, exist_ok=True)
    env = {
        "TORCHPASS_HEALTH_SIMULATE": f"/shared/health/long-life-{tag}/{{node}}.json",
        "TORCHPASS_REFILL_RETRY": "2",
    }
    inject = RepairingFaults(sim)
    inject.healthy_gpus()
    schedule = plan(faults, per_job, seed, size)
    began = time.monotonic()
    jobs.wait_idle()
    progress(
        f"long life: {faults} faults, {per_job} a job on 1 spare (seed {seed}); the fault-free job first"
    )
    ref_job = jobs.run(campaign.submit(fleet, "job-00-no-fault", size, env), jobs.tp_progress)
    ref = jobs.DONE_LINE.search(ref_job.output())
    reference = ref.group(3) if ref and ref_job.state == "COMPLETED" else None
    records: list[dict[str, Any]] = []
    job_rows: list[dict[str, Any]] = []
    all_refills: list[dict[str, Any]] = []
    for number, planned in enumerate(schedule, start=1):
        progress(f"long life: job {number}/{len(schedule)}: " + ", ".join(p.fault_class for p in planned))
        job = run_job(fleet, number, planned, size, inject, env)
        records.extend(campaign.never_injected(job, planned))
        records.extend(campaign.judge(job, reference, size.steps))
        events = ev.read_events(job.event_log())
        hit = [(f["node"], f["kind"], f["wall"]) for f in job.faults]
        job_refills = [{**r, "job": job.job_id} for r in refills(events, hit)]
        all_refills.extend(job_refills)
        job_rows.append(
            {
                "job": job.job_id,
                "folder": job.folder,
                "state": job.state,
                "seconds": round(job.seconds, 2),
                "faults": job.faults,
            }
        )
        live = sum(r["live_no_lost_progress"] for r in records if r["job"] == job.job_id)
        progress(
            f"  job {job.job_id} {job.state}: {live} of {len(planned)} live with no lost progress; "
            f"{len(job_refills)} refills"
        )
        inject.repair(job)
    records.sort(key=lambda r: r["index"])
    return {
        "faults_asked": faults,
        "faults_per_job": per_job,
        "seed": seed,
        "sizing": {**size.__dict__, "model": list(size.model)},
        "train_args": size.train_args(),
        "fleet": fleet,
        "reference_job": ref_job.job_id,
        "reference_params_sha256": reference,
        "seconds": round(time.monotonic() - began, 1),
        "jobs": job_rows,
        "faults": records,
        "totals": campaign.totals(records),
        "refills": all_refills,
        "refill_totals": refill_totals(all_refills),
    }


def refill_totals(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per mechanism: how many, and the median and the largest seconds to a ready spare."""
    out: dict[str, Any] = {}
    for mechanism in sorted({r["mechanism"] for r in rows}):
        seconds = sorted(r["seconds"] for r in rows if r["mechanism"] == mechanism)
        out[mechanism] = {
            "refills": len(seconds),
            "median_s": seconds[len(seconds) // 2],
            "max_s": seconds[-1],
        }
    return out


def table(result: dict[str, Any]) -> str:
    """The campaign's table, and the refills per mechanism."""
    lines = [campaign.table(result), "", "| refill | count | median s | max s |", "|---|---|---|---|"]
    lines += [
        f"| {m} | {t['refills']} | {t['median_s']:.1f} | {t['max_s']:.1f} |"
        for m, t in result["refill_totals"].items()
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.long_life", description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", type=int, default=12, help="faults to inject (default 12)")
    p.add_argument("--faults-per-job", type=int, default=12, help="faults in each job (default 12)")
    p.add_argument("--seed", type=int, default=14, help="seed of the fault generator (default 14)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"results file (default {DEFAULT_JSON})")
    a = p.parse_args(argv)
    if a.faults < 1 or a.faults_per_job < 1:
        p.error("--faults and --faults-per-job must be at least 1")
    result = campaign.run_and_save(lambda: long_life(a.faults, a.faults_per_job, a.seed), a.json)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
