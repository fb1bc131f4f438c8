"""The benchmark runs on the dockerized cluster: each comparison side by side in one session.

- :func:`overhead`: tokens per second of the example training under ``tp run``
  (3 active nodes + 1 hot spare) against the same training under plain
  ``srun`` with torch DDP, alternated run by run so that drift hits both.
- :func:`recovery`: the recovery-time split of one fault of each kind --
  unplanned (a node powered off; again with the state on each transport),
  pre-emptive (its simulated GPU's corrected ECC count jumps; the in-job health
  agent warns, the supervisor drains it) and planned (an admin drain) -- next
  to a fault-free run of the same training.
- :func:`completion`: job completion time with F node failures: live
  migration, the in-allocation checkpoint restart, and classic
  ``sbatch --requeue`` with periodic checkpoints, next to a fault-free run.
- :func:`transfer`: state-transfer throughput against a raw TCP stream
  between two containers, 10 MB to 2 GB (benchmarks/transfer_bench.py).

Each returns a JSON-able dict; :mod:`benchmarks.render` turns them into tables and plots.
"""

from __future__ import annotations

import json
import shutil
import statistics
import uuid
from dataclasses import dataclass
from typing import Any

from benchmarks import jobs
from scripts.devcluster import COMPUTE, FLAVOR
from torchpass_slurm.analysis.report_totals import job_json
from torchpass_slurm.cli.report import load_report
from torchpass_slurm.rundir import events as ev

#: The simulated GPU of every node in the pre-emptive run (healthy).
HEALTHY_GPU = {
    "index": 0,
    "uuid": "GPU-0",
    "temperature_c": 60,
    "slowdown_c": 88,
    "shutdown_c": 95,
    "ecc_corrected": 0,
    "ecc_uncorrected": 0,
}
#: The unplanned fault again, with a short collective timeout: a rank that waits on a
#: dead peer's data is stuck in its collective until this timeout (gloo cannot abort it).
SHORT_COLLECTIVE_TIMEOUT_S = 5.0
UNPLANNED_SHORT = "unplanned, 5 s collective timeout"
#: The unplanned fault again with the state carried by each transport of its own
#: (TORCHPASS_TRANSPORT; "unplanned" itself is the default, the epoch's torch group).
UNPLANNED_BY_TRANSPORT = {
    "unplanned, socket transport": "socket",
    "unplanned, MPI transport": "mpi",
}
#: The corrected-ECC count that makes the health agent warn (a rate far over its threshold).
FAILING_ECC = 50_000


@dataclass(frozen=True)
class Sizing:
    """How long the runs are: steps, fault points, checkpoint interval, model."""

    overhead_steps: int = 150
    overhead_repeats: int = 2
    recovery_steps: int = 60
    recovery_fault_at: int = 15
    completion_steps: int = 100
    completion_failures: int = 2  # nodes powered off; where: fault_steps()
    ckpt_every: int = 20
    step_sleep: float = 0.3
    model: tuple[int, int] = (256, 4)  # d_model, layers: 3.3 M parameters, 39.7 MB of state
    transfer_sizes_mb: tuple[int, ...] = (10, 100, 500, 1000, 2000)
    transfer_repeat: int = 2

    def fault_steps(self, failures: int) -> tuple[int, ...]:
        """``failures`` kill points spread over the completion run, each half a checkpoint
        interval after a checkpoint (what a restart loses on average)."""
        spacing = self.completion_steps / failures
        return tuple(
            int(spacing * i + spacing / 2) // self.ckpt_every * self.ckpt_every + self.ckpt_every // 2
            for i in range(failures)
        )

    def train_args(
        self, steps: int, *, ckpt_every: int = 0, step_sleep: float = 0.0, log_every: int = 1
    ) -> list[str]:
        """tiny_gpt.py's arguments (log every step: the requeue run counts the steps computed)."""
        d_model, layers = self.model
        return [
            "--d-model",
            str(d_model),
            "--n-layers",
            str(layers),
            "--steps",
            str(steps),
            "--ckpt-every",
            str(ckpt_every),
            "--step-sleep",
            str(step_sleep),
            "--log-every",
            str(log_every),
        ]


QUICK = Sizing(
    overhead_steps=30,
    overhead_repeats=1,
    recovery_steps=40,
    recovery_fault_at=10,
    completion_steps=50,
    ckpt_every=10,
    model=(128, 2),
    transfer_sizes_mb=(10, 100),
    transfer_repeat=1,
)


# --- steady-state overhead ------------------------------------------------------


def overhead(size: Sizing) -> dict[str, Any]:
    """tokens/s under tp run and under plain srun + DDP, alternated."""
    args = size.train_args(size.overhead_steps, log_every=10)
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "tp": []}
    for i in range(size.overhead_repeats):
        for name in ("plain", "tp"):
            jobs.wait_idle()
            jobs.progress(
                f"overhead: {name} run {i + 1}/{size.overhead_repeats} ({size.overhead_steps} steps)"
            )
            job = jobs.submit_plain(args) if name == "plain" else jobs.submit_tp(args, spares=1)
            jobs.run(job, jobs.plain_progress if name == "plain" else jobs.tp_progress)
            runs[name].append(_throughput(job))
    median = {name: statistics.median(r["tokens_per_s"] for r in rs) for name, rs in runs.items()}
    losses = {r["final_loss"] for rs in runs.values() for r in rs}
    return {
        "train_args": args,
        "runs": runs,
        "median_tokens_per_s": median,
        "overhead_percent": round(100.0 * (1.0 - median["tp"] / median["plain"]), 2),
        "median_supervisor_core_percent": _median_or_none(
            [r["supervisor_core_percent"] for r in runs["tp"] if "supervisor_core_percent" in r]
        ),
        "same_final_loss": len(losses) == 1,
        "bitwise_equal_within_mode": {
            name: len({r["params_sha256"] for r in rs}) == 1 for name, rs in runs.items()
        },
    }


def _throughput(job: jobs.Job) -> dict[str, Any]:
    out = job.output()
    tput, done = jobs.THROUGHPUT_LINE.search(out), jobs.DONE_LINE.search(out)
    if job.state != "COMPLETED" or not tput or not done:
        raise jobs.BenchError(
            f"job {job.job_id} ended {job.state} without its throughput line; "
            f"the end of its output:\n{out[-1500:]}"
        )
    return {
        "job": job.job_id,
        "job_seconds": round(job.seconds, 2),
        "steps": int(tput.group(1)),
        "seconds": float(tput.group(2)),
        "tokens_per_s": float(tput.group(3)),
        "final_loss": done.group(2),
        "params_sha256": done.group(3),
        **_supervisor_cost(job),
    }


def _median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _supervisor_cost(job: jobs.Job) -> dict[str, float]:
    """A tp run job's own CPU beyond its training (its ``finished`` event), as a share of one
    core over the job's time: the supervisor's threads, and its srun children. Nothing for a
    plain job (no event log)."""
    path = job.event_log()
    if not path.exists():
        return {}
    finished = [e for e in ev.read_events(path) if e.kind == ev.FINISHED]
    if not finished or "supervisor_cpu_s" not in finished[-1].fields:
        return {}
    fields = finished[-1].fields
    return {
        key.replace("_cpu_s", "_core_percent"): round(100.0 * float(fields[key]) / job.seconds, 2)
        for key in ("supervisor_cpu_s", "srun_cpu_s")
    }


# --- recovery-time split ----------------------------------------------------------


def recovery(size: Sizing) -> dict[str, Any]:
    """One fault of each kind, and a fault-free run of the same training."""
    args = size.train_args(size.recovery_steps, ckpt_every=size.ckpt_every, step_sleep=size.step_sleep)
    at = size.recovery_fault_at
    out: dict[str, Any] = {"train_args": args, "fault_at_step": at}
    jobs.wait_idle()
    jobs.progress("recovery: fault-free run")
    out["no_fault"] = _tp_result(jobs.run(jobs.submit_tp(args), jobs.tp_progress))
    for key, env in (
        ("unplanned", None),
        (UNPLANNED_SHORT, {"TORCHPASS_COLLECTIVE_TIMEOUT": str(SHORT_COLLECTIVE_TIMEOUT_S)}),
        *((key, {"TORCHPASS_TRANSPORT": name}) for key, name in UNPLANNED_BY_TRANSPORT.items()),
    ):
        jobs.wait_idle()
        jobs.progress(f"recovery: {key} (a node powered off)")
        job = jobs.run(
            jobs.submit_tp(args, env=env), jobs.tp_progress, [(at, jobs.kill_node(jobs.tp_victim))]
        )
        out[key] = _tp_result(job)
        jobs.restart_nodes([f["node"] for f in job.faults])
    jobs.progress("recovery: pre-emptive (rising ECC counts on a simulated GPU)")
    out["pre-emptive"] = _preemptive(args, at)
    jobs.wait_idle()
    jobs.progress("recovery: planned (an admin drain)")
    out["planned"] = _tp_result(
        jobs.run(jobs.submit_tp(args), jobs.tp_progress, [(at, jobs.drain_node(jobs.tp_victim))])
    )
    jobs.wait_idle()
    return out


def _preemptive(args: list[str], at: int) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    sim = jobs.CLUSTER.shared_host / "health" / f"bench-{tag}"
    sim.mkdir(parents=True)
    try:
        (sim / "health.toml").write_text('disk_paths = ["/shared"]\necc_rate_min_interval_s = 1.0\n')
        for node in COMPUTE:
            (sim / f"{node}.json").write_text(json.dumps({"gpus": [HEALTHY_GPU]}))
        env = {
            "TORCHPASS_HEALTH_SIMULATE": f"/shared/health/bench-{tag}/{{node}}.json",
            "TORCHPASS_HEALTH_CONFIG": f"/shared/health/bench-{tag}/health.toml",
            "TORCHPASS_HEALTH_INTERVAL": "1",
        }

        def ecc_jump(job: jobs.Job) -> dict[str, Any]:
            node = jobs.tp_victim(job)
            gpu = {**HEALTHY_GPU, "ecc_corrected": FAILING_ECC}
            (sim / f"{node}.json").write_text(json.dumps({"gpus": [gpu]}))
            return {"kind": "ecc", "node": node}

        return _tp_result(jobs.run(jobs.submit_tp(args, env=env), jobs.tp_progress, [(at, ecc_jump)]))
    finally:
        shutil.rmtree(sim, ignore_errors=True)


def _tp_result(job: jobs.Job) -> dict[str, Any]:
    """Job time, outcome and the tp report of a tp job."""
    report = job_json(load_report(jobs.CLUSTER.host_path(job.folder)))
    done = jobs.DONE_LINE.search(job.output())
    return {
        "job": job.job_id,
        "state": job.state,
        "seconds": round(job.seconds, 2),
        "injected": job.faults,
        "timeline": job.timeline,
        "faults": report.get("faults", []),
        "params_sha256": done.group(3) if done else None,
    }


# --- job completion with F failures -------------------------------------------------


def completion(size: Sizing) -> dict[str, Any]:
    """The same training, F node failures: live migration, checkpoint restart, requeue."""
    steps, faults = size.completion_steps, size.fault_steps(size.completion_failures)
    args = size.train_args(steps, ckpt_every=size.ckpt_every, step_sleep=size.step_sleep)
    spares = len(faults)
    out: dict[str, Any] = {"train_args": args, "fault_steps": list(faults), "spares": spares}
    jobs.wait_idle()
    jobs.progress(f"completion: fault-free run ({steps} steps)")
    out["no_fault"] = _tp_result(jobs.run(jobs.submit_tp(args, spares=spares), jobs.tp_progress))
    for name, env in (("live", None), ("restart", {"TORCHPASS_RECOVERY": "restart"})):
        jobs.wait_idle()
        jobs.progress(f"completion: {name}, {len(faults)} nodes powered off")
        job = jobs.run(
            jobs.submit_tp(args, spares=spares, env=env),
            jobs.tp_progress,
            [(at, jobs.kill_node(jobs.tp_victim)) for at in faults],
        )
        out[name] = _tp_result(job)
        jobs.restart_nodes([f["node"] for f in job.faults])
    jobs.progress(f"completion: sbatch --requeue, {len(faults)} nodes powered off")
    job = jobs.run(
        jobs.submit_plain(args, requeue=True),
        jobs.plain_progress,
        [(at, jobs.kill_node(jobs.plain_victim)) for at in faults],
    )
    out["requeue"] = _requeue_result(job, steps)
    jobs.restart_nodes([f["node"] for f in job.faults])
    return out


def _requeue_result(job: jobs.Job, steps: int) -> dict[str, Any]:
    """Job time of a requeued plain job, and the steps it computed more than once."""
    text = job.output()
    starts = [int(s) for s in jobs.START_LINE.findall(text)]
    computed = sum(1 for _ in jobs.STEP_LINE.finditer(text))
    done = jobs.DONE_LINE.search(text)
    return {
        "job": job.job_id,
        "state": job.state,
        "seconds": round(job.seconds, 2),
        "injected": job.faults,
        "timeline": job.timeline,
        "starts_at_steps": starts,
        "requeues": max(0, len(starts) - 1),
        "steps_computed": computed,
        "recomputed_steps": computed - steps,
        "params_sha256": done.group(3) if done else None,
    }


# --- transfer ---------------------------------------------------------------------------


def transfer(size: Sizing) -> dict[str, Any]:
    """transfer_bench.py between c4 and c5 (srun -N2): every transport against raw TCP, by size."""
    jobs.wait_idle()
    sizes = ",".join(str(s) for s in size.transfer_sizes_mb)
    folder = jobs.new_folder("transfer")
    jobs.progress(f"transfer: c4 <-> c5, {sizes} MB, best of {size.transfer_repeat}")
    # In-process MPI needs the ranks under Slurm's PMI and a process with no other MPI: the
    # bookworm image's; trixie's torch links Open MPI, so there only the product's helper runs.
    in_process = FLAVOR.name == "bookworm"
    printed = jobs.on(
        "ctl",
        "srun",
        "-N2",
        "-n2",
        "--nodelist=c4,c5",
        *(["--mpi=pmi2"] if in_process else []),
        "python3",
        "/src/benchmarks/transfer_bench.py",
        "--sizes",
        sizes,
        "--mpi",
        "all" if in_process else "helper",
        "--repeat",
        str(size.transfer_repeat),
        "--json",
        f"{folder}/transfer.json",
    )
    result = jobs.read_json(jobs.CLUSTER.host_path(f"{folder}/transfer.json"))
    result["printed"] = printed
    return result
