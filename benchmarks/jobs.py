"""The benchmarks' jobs on the dockerized dev cluster: submit, watch, break.

The cluster itself is driven by scripts/devcluster.py (the driver the tests
and ``scripts/cluster`` use too). Every Slurm and torchpass command runs on the
controller container, as a user of the cluster would; faults are injected
from outside: power loss (the node's container killed), an admin drain
(``scontrol``) or a simulated GPU file (the in-job health agent). Event logs
and job output are read from the host side of ``/shared``.

Nothing here measures: it starts things, waits for them (every wait has a
timeout) and hands back what it saw.
"""

from __future__ import annotations

import json
import re
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scripts.devcluster import Cluster, ClusterError
from torchpass_slurm.rundir import events as ev

CLUSTER = Cluster()
TP_SCRIPT = "/src/sbatch-examples/tiny_gpt_tp.sbatch"
PLAIN_SCRIPT = "/src/sbatch-examples/tiny_gpt.sbatch"

#: How long one command on the controller may take (seconds).
EXEC_TIMEOUT_S = 600.0
#: How long a benchmark job may run before it is cancelled (seconds).
JOB_TIMEOUT_S = 900.0
#: How long the nodes may take to come back idle between runs (seconds).
IDLE_TIMEOUT_S = 240.0
#: Seconds between two polls of a job's progress.
POLL_S = 0.5

FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}
STEP_LINE = re.compile(r"^step=(\d+) loss=", re.MULTILINE)
THROUGHPUT_LINE = re.compile(r"^throughput steps=(\d+) seconds=([\d.]+) tokens_per_s=([\d.]+)", re.MULTILINE)
DONE_LINE = re.compile(r"^done step=(\d+) loss=([\d.na]+) params_sha256=(\w+)", re.MULTILINE)
START_LINE = re.compile(r"starting at step (\d+)")


class BenchError(ClusterError):
    """A benchmark could not run (the cluster or a job misbehaved); the message says what was seen."""


def progress(message: str) -> None:
    """One progress line on stderr, with the time."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def on(node: str, *cmd: str, env: Mapping[str, str] | None = None, check: bool = True) -> str:
    """Run a command on a node (``ctl``, ``c1``..``c5``); its stdout."""
    return CLUSTER.exec(node, *cmd, env=env, check=check, timeout=EXEC_TIMEOUT_S).stdout


def wait_idle(timeout: float = IDLE_TIMEOUT_S) -> None:
    """Every compute node idle (drained or down ones resumed); ClusterError after ``timeout``."""
    CLUSTER.wait_idle(timeout=timeout, resume=True)


@dataclass
class Job:
    """A submitted benchmark job: its id, its folder under /shared, and what was seen of it."""

    job_id: str
    folder: str  # under /shared
    submitted: float  # time.monotonic()
    ended: float | None = None
    state: str = "PENDING"
    faults: list[dict[str, Any]] = field(default_factory=list)
    #: (seconds since submission, state) at every change of state seen
    timeline: list[tuple[float, str]] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        if self.ended is None:
            raise BenchError(f"job {self.job_id} has not ended")
        return self.ended - self.submitted

    def output(self) -> str:
        path = CLUSTER.host_path(f"{self.folder}/slurm-{self.job_id}.out")
        return path.read_text(errors="replace") if path.exists() else ""

    def event_log(self) -> Path:
        """The host path of a tp run job's event log (its run folder's events.jsonl)."""
        return CLUSTER.host_path(f"{self.folder}/{ev.EVENTS_FILE}")


def new_folder(kind: str) -> str:
    folder = f"/shared/bench/{kind}-{uuid.uuid4().hex[:8]}"
    CLUSTER.host_path(folder).mkdir(parents=True, exist_ok=True)
    return folder


def submit_tp(
    train_args: Sequence[str], *, nodes: int = 3, spares: int = 1, env: Mapping[str, str] | None = None
) -> Job:
    """tp-submit the example training (tp run, ``spares`` hot spares)."""
    folder = new_folder("tp")
    job_id = CLUSTER.tp_submit(
        folder, "-N", str(nodes), "--spares", str(spares), TP_SCRIPT, *train_args, env=env
    )
    return Job(job_id, folder, time.monotonic())


def submit_plain(train_args: Sequence[str], *, nodes: int = 3, requeue: bool = False) -> Job:
    """sbatch the example training with plain srun + torch DDP (no torchpass)."""
    folder = new_folder("plain")
    flags = ["--requeue", "--open-mode=append"] if requeue else ["--no-requeue"]
    job_id = CLUSTER.sbatch(
        "-N",
        str(nodes),
        *flags,
        "--output",
        f"{folder}/slurm-%j.out",
        PLAIN_SCRIPT,
        "--plain-ddp",
        "--ckpt-dir",
        f"{folder}/checkpoints",
        *train_args,
    )
    return Job(job_id, folder, time.monotonic())


def job_state(job: Job) -> str:
    out = on("ctl", "squeue", "-h", "-j", job.job_id, "-o", "%T", check=False).strip()
    if out:
        return out
    acct = on("ctl", "scontrol", "show", "job", job.job_id, "-o", check=False)
    match = re.search(r"JobState=(\S+)", acct)
    return match.group(1) if match else "COMPLETED"


def tp_progress(job: Job) -> int:
    """The lowest committed step over the active nodes of a tp job (0 before the first).

    Read from its ``status.json`` in the shared folder, on the host: asking ``tp status`` on
    the controller twice a second started a Python process in the cluster each time, and on
    a 2-core host that slowed the training of every run with a fault to inject (and only
    those) by about 10 %.
    """
    try:
        status = json.loads(CLUSTER.host_path(f"{job.folder}/status.json").read_text())
    except (OSError, ValueError):
        return 0
    steps = [n.get("last_step") or 0 for n in status.get("nodes", []) if n.get("role") == "active"]
    return min(steps) if steps else 0


def plain_progress(job: Job) -> int:
    """The last step a plain job printed (its output is appended across requeues)."""
    steps = STEP_LINE.findall(job.output())
    return int(steps[-1]) if steps else 0


def tp_victim(job: Job) -> str:
    """An active node of a tp job that is not the batch host (the supervisor lives there)."""
    return CLUSTER.tp_victim(job.job_id)


def plain_victim(job: Job) -> str:
    batch = CLUSTER.job_field(job.job_id, "BatchHost")
    others = [n for n in CLUSTER.job_nodes(job.job_id) if n != batch]
    if not others:
        raise BenchError(f"job {job.job_id} runs on no node besides its batch host {batch}")
    return others[-1]


#: One fault to inject: at which committed step, and what it does to the job.
Injector = Callable[[Job], dict[str, Any]]


def run(
    job: Job,
    progress_of: Callable[[Job], int],
    faults: Sequence[tuple[int, Injector]] = (),
    *,
    timeout: float = JOB_TIMEOUT_S,
) -> Job:
    """Wait for the job to end, injecting each fault once its step is reached (in order)."""
    pending = list(faults)
    deadline = time.monotonic() + timeout
    while True:
        job.state = job_state(job)
        if not job.timeline or job.timeline[-1][1] != job.state:
            job.timeline.append((round(time.monotonic() - job.submitted, 2), job.state))
        if job.state in FINAL_STATES:
            break
        if time.monotonic() > deadline:
            on("ctl", "scancel", job.job_id, check=False)
            raise BenchError(f"job {job.job_id} ran past {timeout:.0f} s (state {job.state}); cancelled")
        if pending and job.state == "RUNNING" and progress_of(job) >= pending[0][0]:
            at, inject = pending.pop(0)
            seen = inject(job)
            seen.update(at_step=at, at_seconds=round(time.monotonic() - job.submitted, 2))
            job.faults.append(seen)
            progress(f"  job {job.job_id}: {seen['kind']} of {seen['node']} at step {at}")
        time.sleep(POLL_S)
    job.ended = time.monotonic()
    if pending:
        raise BenchError(f"job {job.job_id} ended ({job.state}) before its fault at step {pending[0][0]}")
    return job


def kill_node(victim_of: Callable[[Job], str]) -> Injector:
    """Power loss: the node's container is killed."""

    def inject(job: Job) -> dict[str, Any]:
        node = victim_of(job)
        CLUSTER.kill(node)
        return {"kind": "kill", "node": node}

    return inject


def drain_node(victim_of: Callable[[Job], str]) -> Injector:
    """Planned maintenance: an admin drains the node (``scontrol update state=drain``)."""

    def inject(job: Job) -> dict[str, Any]:
        node = victim_of(job)
        on("ctl", "scontrol", "update", f"nodename={node}", "state=drain", "reason=bench: maintenance")
        return {"kind": "drain", "node": node}

    return inject


def restart_nodes(nodes: Sequence[str]) -> None:
    """Power killed nodes back on and wait for the whole cluster to be idle."""
    for node in nodes:
        CLUSTER.restart(node)
    wait_idle()


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise BenchError(f"cannot read {path}: {err}") from err
