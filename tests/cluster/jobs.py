"""Submitting the example training on the test cluster, and reading its results back."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from tests.cluster.harness import Cluster, wait_for

EXAMPLE = "/src/sbatch-examples/tiny_gpt_tp.sbatch"
#: Small enough for seconds per run, long enough (with the sleep) to kill a node mid-run.
TRAIN_ARGS = ("--d-model", "64", "--n-layers", "2", "--context", "32", "--steps", "24",
              "--ckpt-every", "4", "--log-every", "4", "--step-sleep", "0.4")
DONE = re.compile(r"^done step=(\d+) loss=(\S+) params_sha256=([0-9a-f]{64}) optim_sha256=([0-9a-f]{64})$", re.M)


@dataclass
class TpJob:
    cluster: Cluster
    job_id: str
    run_dir: str  # as seen on the nodes

    @property
    def host_run_dir(self) -> Path:
        return self.cluster.shared_host / Path(self.run_dir).relative_to("/shared")

    def status(self) -> dict:
        return json.loads(self.cluster.exec("ctl", "tp", "status", self.job_id, "--json").stdout)

    def events(self) -> list[dict]:
        out = self.cluster.exec("ctl", "tp", "events", self.job_id, "--json").stdout
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def kinds(self) -> list[str]:
        return [e["kind"] for e in self.events()]

    def output(self) -> str:
        return (self.host_run_dir / f"slurm-{self.job_id}.out").read_text()

    def last_step(self) -> int:
        try:
            steps = [n["last_step"] or 0 for n in self.status()["nodes"] if n["role"] == "active"]
        except Exception:
            return 0
        return min(steps) if steps else 0

    def wait_step(self, step: int, timeout: float = 180) -> None:
        wait_for(lambda: self.last_step() >= step, timeout=timeout,
                 what=f"job {self.job_id} at step {step}", interval=1)


def submit(c: Cluster, *tp_args: str, train_args: tuple[str, ...] = TRAIN_ARGS,
           env: dict[str, str] | None = None) -> TpJob:
    """tp-submit the example on ctl; ``env`` reaches every rank (sbatch exports it)."""
    run_dir = f"/shared/runs/{uuid.uuid4().hex[:8]}"
    out = c.exec("ctl", "tp-submit", "--parsable", "--run-dir", run_dir,
                 "--output", f"{run_dir}/slurm-%j.out", *tp_args, EXAMPLE, *train_args,
                 env=env).stdout
    return TpJob(c, out.strip(), run_dir)


def active_victim(c: Cluster, job: TpJob) -> str:
    """An active node of the job that is not the batch host (whose loss the job cannot survive)."""
    batch_host = c.job_field(job.job_id, "BatchHost")
    return next(n["node"] for n in job.status()["nodes"]
                if n["role"] == "active" and n["node"] != batch_host)


def kill_rank(c: Cluster, node: str) -> None:
    """SIGKILL the training process on ``node`` (its node stays up)."""
    c.exec(node, "pkill", "-9", "-f", "python3 /src/sbatch-examples/tiny_gpt.py")


def final_hash(job: TpJob) -> str:
    """The final model and optimizer state's hashes: bitwise equality of the whole state."""
    m = DONE.search(job.output())
    assert m, job.output()[-3000:]
    return f"{m.group(3)}/{m.group(4)}"
