"""Per-node heartbeats on the real cluster: 3 nodes x 2 ranks, local rank 0 beating for its node.

``TORCHPASS_HEARTBEAT_PER_NODE_FROM=1`` turns per-node heartbeats on for a job
of any size (the default is 256 nodes). Local rank 1 of each node then hands
its beat to local rank 0 over a node-local socket, and only local rank 0
beats to the supervisor. When local rank 1's process is killed, its entry in
its node's beats ages: the supervisor must find it lost as it would per rank,
move the node to the spare live, and end bitwise equal to the same job
without a fault.
"""

from __future__ import annotations

import pytest

from scripts.devcluster import Cluster
from tests.cluster.jobs import TpJob, active_victim, final_hash, submit
from tests.cluster.test_live_migration import assert_all_live, wait_migrated

pytestmark = pytest.mark.cluster

SHAPE = ("-N", "3", "--ntasks-per-node", "2", "--spares", "1")
PER_NODE = {"TORCHPASS_HEARTBEAT_PER_NODE_FROM": "1"}
#: SIGKILL the training process of local rank 1 on a node (local rank 0 beats on).
KILL_LOCAL_1 = (
    "for p in $(pgrep -f 'python3 /src/sbatch-examples/tiny_gpt.py'); do "
    "tr '\\0' '\\n' < /proc/$p/environ | grep -qx SLURM_LOCALID=1 && kill -9 $p; done; true"
)


def beat_sockets(c: Cluster, job: TpJob, node: str) -> str:
    """The node-local beat sockets of the job on ``node`` (local rank 0 binds them)."""
    return c.exec(
        node, "sh", "-c", f"ls -d /tmp/torchpass-*-{job.job_id}-{node}/beats-e*.ipc", check=False
    ).stdout


def test_a_killed_rank_behind_its_nodes_beats_is_found_and_moved_live(healthy_cluster: Cluster) -> None:
    c = healthy_cluster
    reference = submit(c, *SHAPE, env=PER_NODE)
    assert c.wait_job_done(reference.job_id, timeout=300) == "COMPLETED"
    expected = final_hash(reference)

    job = submit(c, *SHAPE, env=PER_NODE)
    job.wait_step(5)
    victim = active_victim(c, job)
    assert "beats-e0.ipc" in beat_sockets(c, job, victim)  # per-node heartbeats are on
    c.exec(victim, "sh", "-c", KILL_LOCAL_1)
    wait_migrated(job, 1)
    assert c.wait_job_done(job.job_id, timeout=300) == "COMPLETED"
    events = job.events()
    lost = [
        e
        for e in events
        if e["kind"] in ("heartbeat_lost", "rank_hung", "step_exited", "node_down")
        and e.get("exit_code") != 0
    ]
    assert [e["node"] for e in lost] == [victim], lost
    assert_all_live(c, job, 1)
    assert final_hash(job) == expected
