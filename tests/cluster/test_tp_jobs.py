"""tp-submit and tp run on the real cluster: hot spares, node kills, restarts on a spare.

The training is sbatch-examples/tiny_gpt.py, shrunk so that a run takes
seconds; the fault-free run's final weights are the oracle the runs with
faults must reproduce bitwise (they restart from the last checkpoint, and a
rank keeps its logical rank and data shard on the spare).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cluster.harness import Cluster, wait_for

pytestmark = pytest.mark.cluster

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


def submit(c: Cluster, *tp_args: str, train_args: tuple[str, ...] = TRAIN_ARGS) -> TpJob:
    run_dir = f"/shared/runs/{uuid.uuid4().hex[:8]}"
    out = c.exec("ctl", "tp-submit", "--parsable", "--run-dir", run_dir,
                 "--output", f"{run_dir}/slurm-%j.out", *tp_args, EXAMPLE, *train_args).stdout
    return TpJob(c, out.strip(), run_dir)


def final_hash(job: TpJob) -> str:
    """The final model and optimizer state's hashes: bitwise equality of the whole state."""
    m = DONE.search(job.output())
    assert m, job.output()[-3000:]
    return f"{m.group(3)}/{m.group(4)}"


@pytest.fixture(scope="module")
def reference_hash(cluster: Cluster) -> str:
    """The fault-free run: 3 active nodes + 1 spare; also the 'done when' of tp-submit."""
    cluster.ensure_healthy()
    job = submit(cluster, "-N", "3", "--spares", "1")
    wait_for(lambda: job.host_run_dir.joinpath("status.json").exists() and
             all(n["state"] in ("running", "standby") for n in job.status()["nodes"]),
             timeout=120, what="every step up")
    allocated = cluster.exec("ctl", "scontrol", "show", "hostnames",
                             cluster.job_field(job.job_id, "NodeList")).stdout.split()
    assert len(allocated) == 4
    roles = sorted(n["role"] for n in job.status()["nodes"])
    assert roles == ["active", "active", "active", "spare"]
    assert cluster.wait_job_done(job.job_id, timeout=300) == "COMPLETED"
    kinds = job.kinds()
    assert kinds[0] == "started" and kinds[-1] == "finished"
    assert "restarted" not in kinds
    return final_hash(job)


def test_spares_are_allocated_and_training_completes(reference_hash: str) -> None:
    assert re.fullmatch(r"[0-9a-f]{64}/[0-9a-f]{64}", reference_hash)


def test_node_kill_continues_on_spare_with_same_weights(healthy_cluster: Cluster,
                                                        reference_hash: str) -> None:
    c = healthy_cluster
    job = submit(c, "-N", "3", "--spares", "1")
    job.wait_step(6)
    batch_host = c.job_field(job.job_id, "BatchHost")
    victim = next(n["node"] for n in job.status()["nodes"]
                  if n["role"] == "active" and n["node"] != batch_host)
    c.kill(victim)
    assert c.wait_job_done(job.job_id, timeout=300) == "COMPLETED"
    assert c.job_field(job.job_id, "Restarts") == "0"  # never requeued
    events = job.events()
    promoted = [e for e in events if e["kind"] == "spare_promoted"]
    assert len(promoted) == 1 and promoted[0]["replaces"] == victim
    lost = [e for e in events if e["kind"] in ("heartbeat_lost", "node_down", "step_exited")
            and e.get("node") == victim]
    assert lost, events
    assert [e["kind"] for e in events][-1] == "finished"
    status = job.status()
    assert {n["node"]: n["role"] for n in status["nodes"]}[victim] == "failed"
    assert status["restarts"] == 1 and status["epoch"] == 1
    assert final_hash(job) == reference_hash


def test_killed_rank_process_is_replaced(healthy_cluster: Cluster, reference_hash: str) -> None:
    c = healthy_cluster
    job = submit(c, "-N", "3", "--spares", "1")
    job.wait_step(6)
    batch_host = c.job_field(job.job_id, "BatchHost")
    victim = next(n["node"] for n in job.status()["nodes"]
                  if n["role"] == "active" and n["node"] != batch_host)
    c.exec(victim, "pkill", "-9", "-f", "python3 /src/sbatch-examples/tiny_gpt.py")
    assert c.wait_job_done(job.job_id, timeout=300) == "COMPLETED"
    events = job.events()
    blamed = [e for e in events if e["kind"] == "step_exited" and e.get("exit_code")]
    assert blamed and blamed[0]["node"] == victim, events
    assert [e["replaces"] for e in events if e["kind"] == "spare_promoted"] == [victim]
    assert final_hash(job) == reference_hash


def test_no_spare_left_ends_the_job_with_a_clear_message(healthy_cluster: Cluster) -> None:
    c = healthy_cluster
    job = submit(c, "-N", "2", "--spares", "0")
    job.wait_step(2)
    batch_host = c.job_field(job.job_id, "BatchHost")
    victim = next(n["node"] for n in job.status()["nodes"] if n["node"] != batch_host)
    c.exec(victim, "pkill", "-9", "-f", "python3 /src/sbatch-examples/tiny_gpt.py")
    assert c.wait_job_done(job.job_id, timeout=180) == "FAILED"
    failed = [e for e in job.events() if e["kind"] == "failed"]
    assert len(failed) == 1 and "no hot spare left" in failed[0]["message"]
    assert "no hot spare left" in job.output()


def test_too_many_spares_is_refused_before_submitting(healthy_cluster: Cluster) -> None:
    c = healthy_cluster
    before = c.exec("ctl", "squeue", "-h", "-o", "%i").stdout
    proc = c.exec("ctl", "tp-submit", "-N", "3", "--spares", "3", EXAMPLE, check=False)
    assert proc.returncode == 2, proc
    assert "6 nodes" in proc.stderr and "5" in proc.stderr, proc.stderr
    assert c.exec("ctl", "squeue", "-h", "-o", "%i").stdout == before
