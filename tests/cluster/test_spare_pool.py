"""The spare pool refills on the real cluster: one spare carries a job through four node losses.

A job of 3 active nodes and 1 spare on the 5-node cluster. Four times in a
row an active node is powered off and, once the job moved off it, powered on
again, as a site repairs a node. Each loss is a live migration onto the
spare; after each, ``tp run`` asks Slurm for a node by job expansion and
starts a standby on it, so the pool is whole again before the next loss: the
idle node first, then the first repaired one, which the pool asks back once
its slurmd has started again. The final state is bitwise
equal to the fault-free run's (the steps only sleep longer, which changes no
number). ``TP_SPARE_POOL_KILLS`` runs more or fewer losses (the steps sleep
longer for more).

Two more: a node that lost only its process is the pool's next spare, and a
loss with the pool empty holds the job until Slurm frees a node.
"""

from __future__ import annotations

import os
import time

import pytest

from scripts.devcluster import Cluster, wait_for
from tests.cluster.jobs import TRAIN_ARGS, TpJob, active_victim, final_hash, kill_rank, submit
from tests.cluster.test_live_migration import assert_all_live

pytestmark = pytest.mark.cluster

KILLS = int(os.environ.get("TP_SPARE_POOL_KILLS", "4"))
#: Slower steps than the other tests (the same 24 steps): room for the losses and refills.
SLOW = (*TRAIN_ARGS[: TRAIN_ARGS.index("--step-sleep")], "--step-sleep", str(0.75 * KILLS))
#: A refused request is asked again soon (a repaired node takes seconds to come back).
ENV = {"TORCHPASS_REFILL_RETRY": "2", "TORCHPASS_REFILL_WAIT": "20"}


def migrations(job: TpJob) -> list[dict]:
    return [e for e in job.events() if e["kind"] == "migration_done"]


def standby_spares(job: TpJob) -> list[str]:
    return [n["node"] for n in job.status()["nodes"] if n["role"] == "spare" and n["state"] == "standby"]


def test_one_spare_carries_the_job_through_four_node_losses_live(
    healthy_cluster: Cluster, reference_hash: str
) -> None:
    c = healthy_cluster
    job = submit(c, "-N", "3", "--spares", "1", train_args=SLOW, env=ENV)
    job.wait_step(1)
    killed: list[str] = []
    for k in range(KILLS):
        wait_for(lambda: len(standby_spares(job)) == 1, timeout=120, what="a spare on standby", interval=1)
        victim = active_victim(c, job)
        c.kill(victim)
        killed.append(victim)
        wait_for(
            lambda k=k: len(migrations(job)) > k, timeout=120, what=f"migration {k + 1} done", interval=1
        )
        c.restart(victim)  # repaired: back to Slurm, and so to the pool
    assert c.wait_job_done(job.job_id, timeout=300) == "COMPLETED"

    events = job.events()
    done = migrations(job)
    assert [(d["resolution"], d["lost_steps"]) for d in done] == [("live", 0)] * KILLS, done
    assert not [e for e in events if e["kind"] == "restarted"]
    added = [e for e in events if e["kind"] == "spare_added"]
    assert len(added) >= KILLS - 1, [e for e in events if e["kind"].startswith("spare_")]
    promoted = [e["node"] for e in events if e["kind"] == "spare_promoted"]
    assert len(promoted) == KILLS and all(p in [a["node"] for a in added] for p in promoted[1:])
    kills_at = [e["ts"] for e in events if e["kind"] == "migration_started"]
    for a_next, joined in zip(kills_at[1:], added, strict=False):
        assert joined["ts"] < a_next, "the pool was whole again before the next loss"
    assert final_hash(job) == reference_hash
    print(
        "killed "
        + ", ".join(killed)
        + "; refills "
        + ", ".join(f"{a['node']} in {a['seconds']:.1f} s" for a in added)
    )


def test_a_node_that_lost_only_its_process_is_the_spare_for_the_next_loss(
    healthy_cluster: Cluster, reference_hash: str
) -> None:
    """Issue 24, item 4: a rank's process is killed on a node that stays healthy. Its rank moves
    live to the spare, and the node itself rejoins the pool (Slurm is not asked for another,
    though c5 is idle). A second process kill moves that rank live onto it."""
    c = healthy_cluster
    job = submit(c, "-N", "3", "--spares", "1")
    job.wait_step(3)
    first = active_victim(c, job)
    kill_rank(c, first)
    wait_for(lambda: first in standby_spares(job), timeout=120, what=f"{first} back on standby", interval=1)
    second = active_victim(c, job)
    kill_rank(c, second)
    assert c.wait_job_done(job.job_id, timeout=300) == "COMPLETED"

    events = job.events()
    promoted = [e["replaces"] for e in events if e["kind"] == "spare_promoted"]
    assert promoted == [first, second], promoted
    promoted_nodes = [e["node"] for e in events if e["kind"] == "spare_promoted"]
    assert promoted_nodes[1] == first, "the second loss moved onto the node given back"
    added = [(e["node"], e["returned"]) for e in events if e["kind"] == "spare_added"]
    assert added[0] == (first, True), added
    assert not [e for e in events if e["kind"] == "spare_requested"], "a node was coming back"
    assert first not in [e["node"] for e in events if e["kind"] == "node_released"]
    assert_all_live(c, job, 2)
    assert final_hash(job) == reference_hash


def test_a_loss_with_the_pool_empty_holds_the_step_until_slurm_frees_a_node(
    healthy_cluster: Cluster, reference_hash: str
) -> None:
    """Issue 24, item 3: another job holds the only idle node (c5). The first node loss takes the
    spare; the pool asks Slurm in vain. The second loss finds no spare: the survivors hold the
    committed step, and when the other job ends 30 s later the pool gets c5 and the move is live."""
    c = healthy_cluster
    blocker = c.sbatch("-N1", "-w", "c5", "--exclusive", "-J", "other-work", "--wrap", "sleep 600")
    wait_for(lambda: c.job_field(blocker, "JobState") == "RUNNING", timeout=60, what="c5 busy")
    args = (*TRAIN_ARGS[: TRAIN_ARGS.index("--step-sleep")], "--step-sleep", "1.0")
    job = submit(c, "-N", "3", "--spares", "1", "--spare-wait", "180", train_args=args, env=ENV)
    job.wait_step(1)
    first = active_victim(c, job)
    c.kill(first)
    wait_for(lambda: len(migrations(job)) == 1, timeout=120, what="the first move", interval=1)
    second = active_victim(c, job)
    c.kill(second)
    holding = wait_for(
        lambda: [e for e in job.events() if e["kind"] == "holding"],
        timeout=60,
        what="the job holding for a spare",
        interval=1,
    )[0]
    assert holding["failed"] == [second] and holding["wait_s"] == pytest.approx(180, abs=1)
    time.sleep(max(0.0, holding["ts"] + 30 - time.time()))
    c.exec("ctl", "scancel", blocker)  # c5 is free 30 s into the hold
    assert c.wait_job_done(job.job_id, timeout=300) == "COMPLETED"

    events = job.events()
    started = [e for e in events if e["kind"] == "migration_started"]
    assert [(e["failed"], e["spares"]) for e in started] == [
        ([first], started[0]["spares"]),
        ([second], ["c5"]),
    ]
    assert started[1]["held_s"] >= 30, started[1]
    assert "held_s" not in started[0]
    assert [e["node"] for e in events if e["kind"] == "spare_added"] == ["c5"]
    assert_all_live(c, job, 2)
    text = c.exec("ctl", "tp", "report", job.job_id).stdout
    assert f"live (held {started[1]['held_s']:.0f} s for a spare)" in text, text
    assert final_hash(job) == reference_hash
    print(f"held {started[1]['held_s']:.1f} s; c5 freed {30} s into the hold")


def test_a_refill_takes_the_node_of_lower_priority_work(
    healthy_cluster: Cluster, reference_hash: str
) -> None:
    """Issue 24, item 7: a job of the scavenger partition (a lower PriorityTier, preemption on:
    docker/slurm.conf) holds the only idle node, c5. After a loss the pool asks Slurm for a node,
    and Slurm cancels the low-priority job to give it c5: the next loss moves live onto it."""
    c = healthy_cluster
    low = c.sbatch(
        "-N1", "-w", "c5", "-p", "scavenger", "--exclusive", "-J", "low-priority", "--wrap", "sleep 600"
    )
    wait_for(lambda: c.job_field(low, "JobState") == "RUNNING", timeout=60, what="c5 busy")
    args = (*TRAIN_ARGS[: TRAIN_ARGS.index("--step-sleep")], "--step-sleep", "1.0")
    job = submit(c, "-N", "3", "--spares", "1", train_args=args, env=ENV)
    job.wait_step(1)
    first = active_victim(c, job)
    c.kill(first)
    wait_for(lambda: standby_spares(job) == ["c5"], timeout=120, what="c5 a spare on standby", interval=1)
    c.restart(first)
    assert c.job_field(low, "JobState") in ("PREEMPTED", "CANCELLED")
    second = active_victim(c, job)
    c.kill(second)
    assert c.wait_job_done(job.job_id, timeout=300) == "COMPLETED"

    events = job.events()
    assert [e["node"] for e in events if e["kind"] == "spare_added"][:1] == ["c5"]
    assert [e["node"] for e in events if e["kind"] == "spare_promoted"][1] == "c5"
    assert_all_live(c, job, 2)
    assert final_hash(job) == reference_hash
