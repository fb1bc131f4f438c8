"""The MPI transport carries a live migration on the dev cluster, through a node's death and
its donor's death mid-stream.

A DDP job of 3 replicas submitted with ``tp-submit --transport mpi``, its supervisor on the
service node. Rank 2's node is powered off; the spare that takes its rank receives the state
from rank 0 over MPI (MPICH's connect/accept between the two ranks' MPI helper processes,
the port published sealed in the job's store: rank/routes.py). The donor waits before its
second chunk (``TORCHPASS_TEST_STALL_CHUNK``), and in that wait its training process is
killed: the receiver's MPI wait ends (the helper reports the dead peer, or the stall limit
does), the loss folds into the next epoch, and the next donor's stream resumes over MPI after
the chunk the spare already holds. The job completes live and bitwise equal to the fault-free
run, and every state that reached a spare came over MPI.

The same module runs on both dev clusters: tests/cluster_sharded/test_mpi_transport.py
collects it on the bookworm one (Slurm 22.05, torch 2.13); here it runs on trixie (Slurm
24.11, Debian's torch, which links Open MPI into every rank: MPICH runs only in the helper).
"""

from __future__ import annotations

import pytest

from scripts.devcluster import SERVICE_PARTITION, Cluster
from tests.cluster.jobs import MULTI_CHUNK_ARGS, kill_rank, submit
from tests.cluster.test_fault_during_recovery import ENV, check, kill_mid_stream

pytestmark = pytest.mark.cluster

#: Seconds from the agreement until chunk 0 is through over MPI: both ends start their MPI
#: helper (hydra, Python, MPI_Init) and meet through the store before the first byte moves.
MPI_SETTLE_S = 3.0


def test_a_node_kill_then_its_donors_death_move_the_state_over_mpi_live_and_bitwise_equal(
    healthy_cluster: Cluster, multi_chunk_reference: str
) -> None:
    c = healthy_cluster
    job = submit(
        c,
        "--supervisor-partition",
        SERVICE_PARTITION,
        "--transport",
        "mpi",
        "-N",
        "3",
        "--spares",
        "1",
        train_args=MULTI_CHUNK_ARGS,
        env=ENV,
    )
    victim, donor = kill_mid_stream(c, job, "donor", lambda node: kill_rank(c, node), settle=MPI_SETTLE_S)
    log = check(c, job, multi_chunk_reference, victim, donor, resumed=True)
    transfers = [e for e in log if e["kind"] == "transfer_done"]
    assert [t["via"] for t in transfers] == ["mpi"] * len(transfers), transfers
    assert job.status().get("transport") == "mpi", job.status()
