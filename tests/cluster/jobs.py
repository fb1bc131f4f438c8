"""Submitting the example training on the test cluster, and reading its results back."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from scripts.devcluster import Cluster, wait_for

EXAMPLE = "/src/sbatch-examples/tiny_gpt_tp.sbatch"
#: Small enough for seconds per run, long enough (with the sleep) to kill a node mid-run.
TRAIN_ARGS = (
    "--d-model",
    "64",
    "--n-layers",
    "2",
    "--context",
    "32",
    "--steps",
    "24",
    "--ckpt-every",
    "4",
    "--log-every",
    "4",
    "--step-sleep",
    "0.4",
)
#: :data:`TRAIN_ARGS` with a state of several 4 MB chunks (d_model 128, 4 layers), so that a
#: donor can be killed mid-stream, with chunks already moved.
MULTI_CHUNK_ARGS = (
    *TRAIN_ARGS[: TRAIN_ARGS.index("--d-model")],
    "--d-model",
    "128",
    "--n-layers",
    "4",
    *TRAIN_ARGS[TRAIN_ARGS.index("--context") :],
)
DONE = re.compile(
    r"^done step=(\d+) loss=(\S+) params_sha256=([0-9a-f]{64}) optim_sha256=([0-9a-f]{64})$", re.MULTILINE
)


@dataclass
class TpJob:
    cluster: Cluster
    job_id: str
    run_dir: str  # as seen on the nodes

    @property
    def host_run_dir(self) -> Path:
        return self.cluster.host_path(self.run_dir)

    def status(self) -> dict:
        return self.cluster.tp_status(self.job_id)

    def events(self) -> list[dict]:
        out = self.cluster.exec("ctl", "tp", "events", self.job_id, "--json").stdout
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def kinds(self) -> list[str]:
        return [e["kind"] for e in self.events()]

    def output(self) -> str:
        return (self.host_run_dir / f"slurm-{self.job_id}.out").read_text()

    def last_step(self) -> int:
        return self.cluster.tp_step(self.job_id)

    def wait_step(self, step: int, timeout: float = 180) -> None:
        wait_for(
            lambda: self.last_step() >= step,
            timeout=timeout,
            what=f"job {self.job_id} at step {step}",
            interval=1,
        )


#: Every job submitted by this test session, so that a failed test can show what its jobs did.
SUBMITTED: list[TpJob] = []


def submit(
    c: Cluster,
    *tp_args: str,
    train_args: tuple[str, ...] = TRAIN_ARGS,
    env: dict[str, str] | None = None,
    example: str = EXAMPLE,
) -> TpJob:
    """tp-submit an example (the DDP one by default) on ctl; ``env`` reaches every rank
    (sbatch exports it)."""
    run_dir = f"/shared/runs/{uuid.uuid4().hex[:8]}"
    job = TpJob(c, c.tp_submit(run_dir, *tp_args, example, *train_args, env=env), run_dir)
    SUBMITTED.append(job)
    return job


def post_mortem(job: TpJob, lines: int = 80) -> str:
    """What a failed test needs to say about one of its jobs: its event log and the end of its
    output (the supervisor's log lines are in it), read from the shared folder on the host, so
    that it works whatever state the cluster is in."""
    folder = job.host_run_dir
    parts = [f"job {job.job_id}, run folder {job.run_dir}"]
    for name, keep in (("events.jsonl", None), (f"slurm-{job.job_id}.out", lines)):
        try:
            text = (folder / name).read_text(errors="replace").splitlines()
        except OSError as err:
            parts.append(f"--- {name}: cannot read ({err.strerror})")
            continue
        shown = text if keep is None else text[-keep:]
        parts.append(f"--- {name} ({len(shown)} of {len(text)} lines)")
        parts.extend(shown)
    return "\n".join(parts)


def active_victim(c: Cluster, job: TpJob) -> str:
    """An active node of the job that is not the batch host (whose loss the job cannot survive)."""
    return c.tp_victim(job.job_id)


def kill_rank(c: Cluster, node: str) -> None:
    """SIGKILL the training process on ``node`` (its node stays up)."""
    c.exec(node, "pkill", "-9", "-f", "python3 /src/sbatch-examples/tiny_gpt.py")


def final_hash(job: TpJob) -> str:
    """The final model and optimizer state's hashes: bitwise equality of the whole state."""
    m = DONE.search(job.output())
    assert m, job.output()[-3000:]
    return f"{m.group(3)}/{m.group(4)}"
