"""Several ranks per node on the real cluster: 3 nodes x 2 ranks and a spare.

A GPU node runs one rank per GPU, and a node's loss takes all of them at
once: the spare must take every rank of the lost node in the same recovery.
Both tests end bitwise equal to the same job without a fault.

* A node's power cut: both of its ranks are received live on the spare.
* Per-node heartbeats (``TORCHPASS_HEARTBEAT_PER_NODE_FROM=1`` turns them on for
  a job of any size; the default is 256 nodes): local rank 1 of each node hands
  its beat to local rank 0 over a node-local socket, and only local rank 0 beats
  to the supervisor. When local rank 1's process is killed, its entry in its
  node's beats ages: the supervisor must find it lost as it would per rank and
  move the node to the spare live.
"""

from __future__ import annotations

import pytest

from scripts.devcluster import Cluster
from tests.cluster.jobs import TpJob, active_victim, final_hash, submit
from tests.cluster.test_live_migration import assert_all_live, wait_migrated

pytestmark = pytest.mark.cluster

SHAPE = ("-N", "3", "--ntasks-per-node", "2", "--spares", "1")
RANKS_PER_NODE = 2
PER_NODE = {"TORCHPASS_HEARTBEAT_PER_NODE_FROM": "1"}
#: SIGKILL the training process of local rank 1 on a node (local rank 0 beats on).
KILL_LOCAL_1 = (
    "for p in $(pgrep -f 'python3 /src/sbatch-examples/tiny_gpt.py'); do "
    "tr '\\0' '\\n' < /proc/$p/environ | grep -qx SLURM_LOCALID=1 && kill -9 $p; done; true"
)


@pytest.fixture(scope="module")
def reference_2x(cluster: Cluster) -> str:
    """The final state's hashes of the 3 x 2 job without a fault."""
    cluster.ensure_healthy()
    reference = submit(cluster, *SHAPE)
    assert cluster.wait_job_done(reference.job_id, timeout=300) == "COMPLETED"
    return final_hash(reference)


def beat_sockets(c: Cluster, job: TpJob, node: str) -> str:
    """The node-local beat sockets of the job on ``node`` (local rank 0 binds them)."""
    return c.exec(
        node, "sh", "-c", f"ls -d /tmp/torchpass-*-{job.job_id}-{node}/beats-e*.ipc", check=False
    ).stdout


def test_a_killed_node_moves_all_its_ranks_to_the_spare_live(
    healthy_cluster: Cluster, reference_2x: str
) -> None:
    c = healthy_cluster
    job = submit(c, *SHAPE)
    job.wait_step(5)
    victim = active_victim(c, job)
    c.kill(victim)
    assert c.wait_job_done(job.job_id, timeout=300) == "COMPLETED"
    events = job.events()
    promoted = [(e["replaces"], e["mode"]) for e in events if e["kind"] == "spare_promoted"]
    assert promoted == [(victim, "live")], events
    assert_all_live(c, job, 1)
    transfers = [e for e in events if e["kind"] == "transfer_done"]
    receivers = sorted(t["receiver"] for t in transfers)
    # Both ranks of the lost node's slot, received in the one recovery, each from a survivor.
    assert len(receivers) == RANKS_PER_NODE and receivers[0] % RANKS_PER_NODE == 0, transfers
    assert receivers == list(range(receivers[0], receivers[0] + RANKS_PER_NODE)), transfers
    assert all(t["donor"] not in receivers for t in transfers), transfers
    assert all(t["bytes"] > 1_000_000 and t["sealed"] is True for t in transfers), transfers
    assert final_hash(job) == reference_2x


def test_a_killed_rank_behind_its_nodes_beats_is_found_and_moved_live(
    healthy_cluster: Cluster, reference_2x: str
) -> None:
    c = healthy_cluster
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
    assert final_hash(job) == reference_2x
