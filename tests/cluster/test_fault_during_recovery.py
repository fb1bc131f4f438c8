"""A fault during a recovery stays live: the donor dies while it streams the state to the spare.

A DDP job of 3 replicas, its supervisor on the service node (every training node can be lost).
An active node is powered off; the spare that takes its rank receives the state from a
surviving replica, the donor. Each donor waits before its second chunk
(``TORCHPASS_TEST_STALL_CHUNK``, once per process), and in that wait the test kills the donor:
its process, or its node. The second loss folds into the next epoch: a node takes the donor's
rank, the last original replica streams the state to it and to the first spare (which resumes
after the chunk it already holds), and the job completes live, bitwise equal to the fault-free
run, with no survivor lost on the way. With one spare, the pool is empty when the donor dies:
a donor whose process died is its own spare (its node lives), and a donor whose node died is
held for until the refill's node joins. With two spares, the same holds when the second loss
is the spare that receives (the next spare takes its rank) or the survivor waiting in the
handover's barrier.

The training is larger than the other tests' (``MULTI_CHUNK_ARGS``: a state of several 4 MB
chunks, so that "mid-stream" means chunks already moved), so it has its own fault-free run
(``multi_chunk_reference``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest

from scripts.devcluster import SERVICE_PARTITION, Cluster, wait_for
from tests.cluster.jobs import MULTI_CHUNK_ARGS, TpJob, final_hash, kill_rank, submit
from tests.cluster.test_live_migration import assert_all_live

pytestmark = pytest.mark.cluster

#: The donor waits this long before chunk 1: the test's window to kill it mid-stream.
STALL_S = 8
ENV = {"TORCHPASS_TEST_STALL_CHUNK": f"1:{STALL_S}"}


def events(job: TpJob) -> list[dict]:
    """The event log read on the host: quicker than ``tp events``, for a kill on cue."""
    try:
        text = (job.host_run_dir / "events.jsonl").read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def rank_nodes(job: TpJob) -> dict[int, str]:
    return {r: n["node"] for n in job.status()["nodes"] if n["role"] == "active" for r in n["ranks"]}


def kill_mid_stream(
    c: Cluster, job: TpJob, who: str, kill: Callable[[str], None], settle: float = 1.0
) -> tuple[str, str]:
    """Power off rank 2's node, then, while the donor streaming to its spare waits before
    chunk 1, ``kill`` the node of ``who``: the ``donor``, the ``receiver`` (the promoted
    spare) or the ``bystander`` (the survivor outside the transfer, in the handover's
    barrier). ``settle``: seconds from the agreement until the manifest and chunk 0 are
    through. The two nodes."""
    job.wait_step(4)
    nodes = rank_nodes(job)
    victim = nodes[2]
    c.kill(victim)
    agreement = wait_for(
        lambda: next((e for e in events(job) if e["kind"] == "agreement"), None),
        timeout=60,
        what="the recovery's agreement",
        interval=0.1,
    )
    assert agreement["receivers"] == [2] and agreement["donors"] == [0, 1], agreement
    spare = next(e["node"] for e in events(job) if e["kind"] == "spare_promoted")
    second = {"donor": nodes[0], "receiver": spare, "bystander": nodes[1]}[who]
    time.sleep(settle)  # the manifest and chunk 0 are through: the donor is mid-stream
    assert time.time() - agreement["ts"] < STALL_S - 2, "too late for the donor's stall"
    kill(second)
    return victim, second


def check(c: Cluster, job: TpJob, reference: str, victim: str, second: str, *, resumed: bool) -> list[dict]:
    """The job completed live and bitwise equal; only ``victim`` and ``second`` were replaced,
    in one recovery; with ``resumed``, the spare kept the chunks it had received. The events."""
    assert c.wait_job_done(job.job_id, timeout=300) == "COMPLETED"
    log = events(job)
    promoted = [e["replaces"] for e in log if e["kind"] == "spare_promoted"]
    assert promoted == [victim, second], promoted  # no survivor was lost besides
    transfers = [e for e in log if e["kind"] == "transfer_done"]
    assert transfers and all(t["sealed"] for t in transfers), transfers
    if resumed:
        assert any(t["resumed_from"] >= 1 for t in transfers), (
            f"no transfer resumed after the chunks the dead donor had sent: {transfers}"
        )
    # One recovery: the second loss folded into the next epoch, which replaced both nodes.
    assert [sorted(d["failed"]) for d in log if d["kind"] == "migration_done"] == [sorted([victim, second])]
    assert_all_live(c, job, 2, recoveries=1)
    assert final_hash(job) == reference
    return log


#: (who dies in the donor's wait, how, whether the spare keeps the chunks it had received,
#: spares reserved)
DEATHS = [
    pytest.param("donor", "process", True, 1, id="donor-process-its-own-spare"),
    pytest.param("donor", "node", True, 1, id="donor-node-held-for-the-refill"),
    pytest.param("receiver", "node", False, 2, id="receiving-spare-node"),  # its chunks die with it
    pytest.param("bystander", "process", True, 2, id="survivor-in-the-barrier-process"),
]


@pytest.mark.parametrize(("who", "how", "resumed", "spares"), DEATHS)
def test_a_death_mid_stream_folds_into_one_live_recovery(
    healthy_cluster: Cluster, multi_chunk_reference: str, who: str, how: str, resumed: bool, spares: int
) -> None:
    c = healthy_cluster
    job = submit(
        c,
        "--supervisor-partition",
        SERVICE_PARTITION,
        "-N",
        "3",
        "--spares",
        str(spares),
        train_args=MULTI_CHUNK_ARGS,
        env=ENV,
    )
    kill = c.kill if how == "node" else (lambda node: kill_rank(c, node))
    victim, second = kill_mid_stream(c, job, who, kill)
    log = check(c, job, multi_chunk_reference, victim, second, resumed=resumed)
    if spares == 1 and how == "process":  # its node outlived the process: it took the rank back
        in_place = [e["node"] for e in log if e["kind"] == "spare_promoted" and e.get("in_place")]
        assert in_place == [second], log
    elif spares == 1:  # the pool was empty: the job held, and the refill's node took the rank
        holding = [e for e in log if e["kind"] == "holding"]
        assert [h["failed"] for h in holding] == [[second]], holding
        added = [e["node"] for e in log if e["kind"] == "spare_added"]
        assert added and any(e["kind"] == "spare_promoted" and e["node"] == added[0] for e in log), log
