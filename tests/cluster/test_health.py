"""Node health on the real cluster, with simulated GPUs (the nodes have none).

The cluster's Prolog (docker/prolog.sh) runs `tp health prolog` on a node that
has a simulated GPU file /shared/health/<node>.json. The in-job agent reads
the file named by TORCHPASS_HEALTH_SIMULATE ({node} = the node's name).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.devcluster import Cluster, wait_for
from tests.cluster.jobs import active_victim, final_hash, submit

pytestmark = pytest.mark.cluster

GPU = {
    "index": 0,
    "uuid": "GPU-0",
    "temperature_c": 60,
    "slowdown_c": 88,
    "shutdown_c": 95,
    "ecc_corrected": 0,
    "ecc_uncorrected": 0,
}


@pytest.fixture
def health_dir(healthy_cluster: Cluster) -> Iterator[Path]:
    """/shared/health on the host; emptied afterwards (no node keeps simulated GPUs)."""
    d = healthy_cluster.shared_host / "health"
    d.mkdir(exist_ok=True)
    try:
        yield d
    finally:
        for f in d.glob("*.json"):
            f.unlink()


def reason(c: Cluster, node: str) -> str:
    return c.node_json(node).get("reason", "")


def test_prolog_drains_a_node_with_a_lost_gpu_and_the_job_runs_elsewhere(
    healthy_cluster: Cluster, health_dir: Path
) -> None:
    c = healthy_cluster
    (health_dir / "c1.json").write_text(json.dumps({"gpus": [GPU, {"index": 1, "lost": True}]}))
    tag = uuid.uuid4().hex[:8]
    job = c.sbatch("-N", "4", "-o", f"/shared/prolog-{tag}.out", "--wrap", "srun hostname | sort")
    # The failed prolog drains c1 and requeues the job, which Slurm then holds for 120 s
    # (a requeued job's BeginTime); what an admin would do, the test does: start it now.
    wait_for(lambda: c.job_field(job, "Restarts") != "0", timeout=60, what="the job requeued")
    c.exec("ctl", "scontrol", "update", f"JobId={job}", "StartTime=now")
    assert c.wait_job_done(job, timeout=120) == "COMPLETED"
    assert c.read_shared(f"prolog-{tag}.out").split() == ["c2", "c3", "c4", "c5"]
    assert "DRAIN" in c.node_json("c1")["state"]
    assert reason(c, "c1").startswith("torchpass:"), reason(c, "c1")
    # tp health undrain resumes what torchpass drained (the GPU is fixed first)
    (health_dir / "c1.json").unlink()
    out = c.exec("ctl", "tp", "health", "undrain", "c1").stdout
    assert "c1" in out
    wait_for(lambda: c.node_states()["c1"] == "idle", timeout=60, what="c1 resumed")


def test_a_broken_gpu_library_never_drains(healthy_cluster: Cluster, health_dir: Path) -> None:
    c = healthy_cluster
    (health_dir / "c1.json").write_text(json.dumps({"broken": "NVML_ERROR_LIB_RM_VERSION_MISMATCH"}))
    tag = uuid.uuid4().hex[:8]
    job = c.sbatch("-N", "1", "-w", "c1", "-o", f"/shared/broken-{tag}.out", "--wrap", "hostname")
    assert c.wait_job_done(job, timeout=120) == "COMPLETED"
    assert c.read_shared(f"broken-{tag}.out").split() == ["c1"]
    assert c.node_states()["c1"] == "idle"
    assert (
        c.exec(
            "ctl",
            "tp",
            "health",
            "check",
            "--json",
            check=False,
            env={"TORCHPASS_HEALTH_SIMULATE": "/shared/health/c1.json"},
        ).returncode
        == 3
    )  # UNKNOWN


def test_rising_ecc_counts_migrate_the_node_before_it_fails(
    healthy_cluster: Cluster, health_dir: Path, reference_hash: str
) -> None:
    c = healthy_cluster
    tag = uuid.uuid4().hex[:8]
    sim = health_dir / f"agent-{tag}"
    sim.mkdir()
    (sim / "health.toml").write_text('disk_paths = ["/shared"]\necc_rate_min_interval_s = 1.0\n')
    for node in ("c1", "c2", "c3", "c4", "c5"):
        (sim / f"{node}.json").write_text(json.dumps({"gpus": [GPU]}))
    job = submit(
        c,
        "-N",
        "3",
        "--spares",
        "1",
        env={
            "TORCHPASS_HEALTH_SIMULATE": f"/shared/health/agent-{tag}/{{node}}.json",
            "TORCHPASS_HEALTH_CONFIG": f"/shared/health/agent-{tag}/health.toml",
            "TORCHPASS_HEALTH_INTERVAL": "1",
        },
    )
    job.wait_step(5)
    node = active_victim(c, job)
    (sim / f"{node}.json").write_text(json.dumps({"gpus": [{**GPU, "ecc_corrected": 50_000}]}))
    wait_for(
        lambda: c.node_states()[node] == "drained",
        timeout=120,
        what=f"{node} drained and released",
        interval=2,
    )
    assert reason(c, node).startswith("torchpass: pre-emptive"), reason(c, node)
    assert c.wait_job_done(job.job_id, timeout=300) == "COMPLETED"
    events = job.events()
    kinds = [e["kind"] for e in events]
    assert "health_warning" in kinds and "migration_started" in kinds, kinds
    assert not {"heartbeat_lost", "rank_hung", "node_down", "restarted"} & set(kinds), kinds
    done = [e for e in events if e["kind"] == "migration_done"]
    assert [(d["resolution"], d["lost_steps"]) for d in done] == [("live", 0)], done
    assert final_hash(job) == reference_hash
