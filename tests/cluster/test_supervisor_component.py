"""The supervisor in its own component (tp-submit --supervisor-partition): every GPU node replaceable.

The job is heterogeneous: component 0 (partition ``service``, node s1) runs the batch script,
``tp run`` and the rendezvous store; component 1 holds the 3 + 1 training nodes. The node of
rank 0, which today's layout cannot lose, is powered off or drained mid-run; the job moves its
rank live to the spare and ends bitwise equal to the fault-free run (``reference_hash``, today's
layout: the same training, so the same state).

Measured on Slurm 24.11.5 (docs/design/supervisor-component.md): when Slurm itself marks a
node of component 1 DOWN, it kills (or requeues) the whole heterogeneous job, ``--no-kill`` or
not; the job lives because the supervisor shrinks component 1 without the lost node first,
seconds after the power cut, where Slurm waits SlurmdTimeout (30 s here).
"""

from __future__ import annotations

import pytest

from scripts.devcluster import SERVICE, SERVICE_PARTITION, Cluster, wait_for
from tests.cluster.jobs import TpJob, final_hash, submit
from tests.cluster.test_live_migration import assert_all_live, migrations_done

pytestmark = pytest.mark.cluster


def submit_with_supervisor_component(c: Cluster) -> TpJob:
    return submit(c, "--supervisor-partition", SERVICE_PARTITION, "-N", "3", "--spares", "1")


def component_nodes(c: Cluster, job: TpJob) -> list[str]:
    """The training component's nodes now (component 1: the job id after the leader's)."""
    return c.hostnames(c.job_field(str(int(job.job_id) + 1), "NodeList"))


def rank0_node(c: Cluster, job: TpJob) -> str:
    job.wait_step(5)
    assert c.job_field(job.job_id, "BatchHost") == SERVICE[0]
    (node,) = [n["node"] for n in job.status()["nodes"] if 0 in n.get("ranks", [])]
    assert node != SERVICE[0]
    return str(node)


def test_rank0_node_powered_off_migrates_live(healthy_cluster: Cluster, reference_hash: str) -> None:
    c = healthy_cluster
    job = submit_with_supervisor_component(c)
    victim = rank0_node(c, job)
    c.kill(victim)
    wait_for(
        lambda: victim not in component_nodes(c, job),
        timeout=25,
        what=f"{victim} released from the training component before Slurm's SlurmdTimeout",
        interval=1,
    )
    assert c.wait_job_done(job.job_id, timeout=300) == "COMPLETED"
    assert c.job_field(job.job_id, "Restarts") == "0"
    promoted = [(e["replaces"], e["mode"]) for e in job.events() if e["kind"] == "spare_promoted"]
    assert promoted == [(victim, "live")]
    assert_all_live(c, job, 1)
    assert final_hash(job) == reference_hash


def test_rank0_node_drained_moves_live_and_ends_drained(
    healthy_cluster: Cluster, reference_hash: str
) -> None:
    c = healthy_cluster
    job = submit_with_supervisor_component(c)
    victim = rank0_node(c, job)
    c.exec("ctl", "scontrol", "update", f"nodename={victim}", "state=drain", "reason=maintenance window")
    wait_for(
        lambda: c.node_states()[victim] == "drained",
        timeout=120,
        what=f"{victim} DRAINED (released by the job)",
        interval=2,
    )
    assert victim not in component_nodes(c, job)
    assert c.wait_job_done(job.job_id, timeout=300) == "COMPLETED"
    events = job.events()
    started = [e for e in events if e["kind"] == "migration_started"]
    assert len(started) == 1 and started[0]["mode"] == "planned", events
    assert not [e for e in events if e["kind"] == "drain_deferred"], events
    done = migrations_done(job)
    assert [(d["resolution"], d["lost_steps"], d["recomputed_steps"]) for d in done] == [("live", 0, 0)], done
    assert [e["released"] for e in events if e["kind"] == "node_released"] == [True]
    assert final_hash(job) == reference_hash
