"""tp-submit and tp run on the real cluster: hot spares, the checkpoint-restart path.

The training is sbatch-examples/tiny_gpt.py, shrunk so that a run takes
seconds. These tests force ``TORCHPASS_RECOVERY=restart``: a lost rank's slot
goes to a spare and every rank restarts from the last checkpoint (the
baseline live migration is measured against). The fault-free run's final
model and optimizer state (the ``reference_hash`` fixture) is the oracle the
restarted runs must reproduce bitwise.
"""

from __future__ import annotations

import re

import pytest

from scripts.devcluster import Cluster
from tests.cluster.jobs import EXAMPLE, active_victim, final_hash, kill_rank, submit

pytestmark = pytest.mark.cluster

RESTART = {"TORCHPASS_RECOVERY": "restart"}


def test_spares_are_allocated_and_training_completes(reference_hash: str) -> None:
    assert re.fullmatch(r"[0-9a-f]{64}/[0-9a-f]{64}", reference_hash)


def test_node_kill_restarts_on_spare_with_same_state(healthy_cluster: Cluster, reference_hash: str) -> None:
    c = healthy_cluster
    job = submit(c, "-N", "3", "--spares", "1", env=RESTART)
    job.wait_step(6)
    victim = active_victim(c, job)
    c.kill(victim)
    assert c.wait_job_done(job.job_id, timeout=300) == "COMPLETED"
    assert c.job_field(job.job_id, "Restarts") == "0"  # never requeued
    events = job.events()
    promoted = [e for e in events if e["kind"] == "spare_promoted"]
    assert len(promoted) == 1 and promoted[0]["replaces"] == victim
    lost = [
        e
        for e in events
        if e["kind"] in ("heartbeat_lost", "node_down", "step_exited") and e.get("node") == victim
    ]
    assert lost, events
    done = [e for e in events if e["kind"] == "migration_done"]
    assert len(done) == 1 and done[0]["resolution"] == "checkpoint", events
    assert [e["kind"] for e in events][-1] == "finished"
    status = job.status()
    assert {n["node"]: n["role"] for n in status["nodes"]}[victim] == "failed"
    assert status["restarts"] == 1 and status["epoch"] == 1
    assert final_hash(job) == reference_hash


def test_killed_rank_process_is_replaced(healthy_cluster: Cluster, reference_hash: str) -> None:
    c = healthy_cluster
    job = submit(c, "-N", "3", "--spares", "1", env=RESTART)
    job.wait_step(6)
    victim = active_victim(c, job)
    kill_rank(c, victim)
    assert c.wait_job_done(job.job_id, timeout=300) == "COMPLETED"
    events = job.events()
    blamed = [e for e in events if e["kind"] == "step_exited" and e.get("exit_code")]
    assert blamed and blamed[0]["node"] == victim, events
    assert [e["replaces"] for e in events if e["kind"] == "spare_promoted"] == [victim]
    assert final_hash(job) == reference_hash


def test_a_lost_node_with_no_spare_left_ends_the_job_with_a_clear_message(healthy_cluster: Cluster) -> None:
    c = healthy_cluster
    job = submit(c, "-N", "2", "--spares", "0")
    job.wait_step(2)
    c.kill(active_victim(c, job))
    assert c.wait_job_done(job.job_id, timeout=180) == "FAILED"
    failed = [e for e in job.events() if e["kind"] == "failed"]
    assert len(failed) == 1 and "no hot spare left" in failed[0]["message"]
    assert "no hot spare left" in job.output()


def test_a_crash_with_no_spare_left_moves_the_rank_live_onto_its_own_node(
    healthy_cluster: Cluster, reference_hash: str
) -> None:
    """The node outlived its rank's process and a replica holds the state: the node is its own
    spare, no step is computed again (it restarted in place from the checkpoint before)."""
    c = healthy_cluster
    job = submit(c, "-N", "3", "--spares", "0")
    job.wait_step(6)
    victim = active_victim(c, job)
    kill_rank(c, victim)
    assert c.wait_job_done(job.job_id, timeout=300) == "COMPLETED"
    events = job.events()
    started = [e for e in events if e["kind"] == "migration_started"]
    assert [(e["mode"], e["failed"], e["spares"]) for e in started] == [("live", [victim], [victim])], events
    done = [e for e in events if e["kind"] == "migration_done"]
    assert [(d["resolution"], d["lost_steps"]) for d in done] == [("live", 0)], done
    assert not [e for e in events if e["kind"] == "restarted"], events
    assert final_hash(job) == reference_hash


def test_too_many_spares_is_refused_before_submitting(healthy_cluster: Cluster) -> None:
    c = healthy_cluster
    before = c.exec("ctl", "squeue", "-h", "-o", "%i").stdout
    proc = c.exec("ctl", "tp-submit", "-N", "3", "--spares", "3", EXAMPLE, check=False)
    assert proc.returncode == 2, proc
    assert "6 nodes" in proc.stderr and "5" in proc.stderr, proc.stderr
    assert c.exec("ctl", "squeue", "-h", "-o", "%i").stdout == before
