"""Detection and recovery time, by kind of fault, with the detectors' settings side by side.

Four faults, each injected once into the same training (3 active nodes, one
hot spare) when it reaches the fault step:

    rank process killed   SIGKILL to the training process (its node stays up)
    node killed           the node's container is killed (power loss)
    rank hung             SIGSTOP to the training process (it neither heartbeats nor steps)
    rank stuck in Python  SIGUSR1: its training thread hangs before its next step
                          (tiny_gpt.py --hang-on-sigusr1); its heartbeats go on
    node partitioned      the node is cut off the cluster network (it runs on, unheard)

Each runs under the current defaults and under the settings the supervisor
had before detection weighed its evidence (2 s heartbeats, 6 s silence
threshold, 20 s heartbeat timeout, 7 s settle, no hang detector), set through the
``TORCHPASS_<SETTING>`` variables, in the same session. Times are measured
from the injection (wall clock of the host, which the containers share) to
the job's first loss event (``detection``) and to rank 0's first committed
step of the new epoch (``fault to first step``); ``rebuild`` is the slowest
rank's ``group_rebuilt``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from benchmarks import jobs
from benchmarks.runs import Sizing
from torchpass_slurm.rundir import events as ev

#: The supervisor's settings before issue 12 (the baseline of this benchmark).
#: It had no hang detector: its floor is set out of reach.
PREVIOUS_SETTINGS = {
    "TORCHPASS_HEARTBEAT_INTERVAL": "2",
    "TORCHPASS_SILENCE_THRESHOLD": "6",
    "TORCHPASS_HEARTBEAT_TIMEOUT": "20",
    "TORCHPASS_FAULT_SETTLE": "7",
    "TORCHPASS_HANG_FLOOR": "100000",
}
SETTINGS = {"current": {}, "previous": PREVIOUS_SETTINGS}
TRAINING = "python3 /src/sbatch-examples/tiny_gpt.py"
LOSS_EVENTS = (ev.HEARTBEAT_LOST, ev.RANK_HUNG, ev.STEP_EXITED, ev.NODE_DOWN)


def _signal_rank(signal_name: str, kind: str) -> jobs.Injector:
    def inject(job: jobs.Job) -> dict[str, Any]:
        node = jobs.tp_victim(job)
        at = time.time()
        jobs.on(node, "pkill", f"-{signal_name}", "-f", TRAINING)
        return {"kind": kind, "node": node, "wall": at}

    return inject


def _cluster_fault(action: Callable[[str], None], kind: str) -> jobs.Injector:
    def inject(job: jobs.Job) -> dict[str, Any]:
        node = jobs.tp_victim(job)
        at = time.time()
        action(node)
        return {"kind": kind, "node": node, "wall": at}

    return inject


CASES: dict[str, jobs.Injector] = {
    "rank process killed": _signal_rank("KILL", "rank-kill"),
    "node killed": _cluster_fault(jobs.CLUSTER.kill, "kill"),
    "rank hung": _signal_rank("STOP", "rank-stop"),
    "rank stuck in Python": _signal_rank("USR1", "rank-stuck"),
    "node partitioned": _cluster_fault(jobs.CLUSTER.partition, "partition"),
}


def detection(size: Sizing) -> dict[str, Any]:
    """Every case under every setting: detection, fault to first step, rebuild, evidence."""
    args = [
        *size.train_args(size.recovery_steps, ckpt_every=size.ckpt_every, step_sleep=size.step_sleep),
        "--hang-on-sigusr1",
    ]
    out: dict[str, Any] = {
        "train_args": args,
        "fault_at_step": size.recovery_fault_at,
        "previous_settings": PREVIOUS_SETTINGS,
        "cases": {},
    }
    for case, inject in CASES.items():
        for name, env in SETTINGS.items():
            jobs.wait_idle()
            jobs.progress(f"detection: {case}, {name} settings")
            job = jobs.run(
                jobs.submit_tp(args, env=env or None), jobs.tp_progress, [(size.recovery_fault_at, inject)]
            )
            out["cases"].setdefault(case, {})[name] = measure(job)
            _repair(job)
    return out


def measure(job: jobs.Job) -> dict[str, Any]:
    """What one run's event log says about its one fault."""
    (fault,) = job.faults
    events = ev.read_events(job.event_log())
    return {
        "job": job.job_id,
        "state": job.state,
        "seconds": round(job.seconds, 2),
        "injected": {k: v for k, v in fault.items() if k != "wall"},
        **timings(events, fault["wall"]),
    }


def timings(events: list[ev.Event], injected: float) -> dict[str, Any]:
    """Detection, fault to first step and rebuild (seconds) of the first fault after ``injected``."""
    loss = next(
        (e for e in events if e.kind in LOSS_EVENTS and e.ts >= injected and e.fields.get("exit_code") != 0),
        None,
    )
    if loss is None:
        return {"detection_s": None, "first_step_s": None, "rebuild_s": None, "evidence": None}
    first = next((e for e in events if e.kind == ev.FIRST_STEP and e.epoch > loss.epoch), None)
    rebuilt = [
        float(e.fields["seconds"]) for e in events if e.kind == ev.GROUP_REBUILT and e.epoch == loss.epoch + 1
    ]
    return {
        "detection_s": round(loss.ts - injected, 2),
        "first_step_s": round(first.ts - injected, 2) if first else None,
        "rebuild_s": round(max(rebuilt), 2) if rebuilt else None,
        "evidence": loss.fields.get("evidence"),
        "detector": loss.fields.get("detector"),
    }


def _repair(job: jobs.Job) -> None:
    """Power the killed node on, plug the cut one back in, free the stopped or stuck rank's node."""
    for fault in job.faults:
        node = fault["node"]
        if fault["kind"] == "partition" and not jobs.CLUSTER.attached(node):
            jobs.CLUSTER.heal(node)
        elif fault["kind"] in ("rank-stop", "rank-stuck"):
            jobs.on(node, "pkill", "-KILL", "-f", TRAINING, check=False)
    jobs.CLUSTER.ensure_healthy()


def table(r: Mapping[str, Any]) -> list[str]:
    """Markdown rows: one per case and setting."""
    rows = []
    for case, by_setting in r["cases"].items():
        for name, run in by_setting.items():
            rows.append(
                [
                    case,
                    name,
                    run["state"],
                    _s(run["detection_s"]),
                    _s(run["first_step_s"]),
                    _s(run["rebuild_s"]),
                    str(run.get("evidence") or "-"),
                    _s(run["seconds"], 1),
                ]
            )
    header = (
        "fault",
        "settings",
        "job",
        "detection (s)",
        "fault to first step (s)",
        "slowest rebuild (s)",
        "evidence",
        "job time (s)",
    )
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _s(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
