"""Live migration on the real cluster: the oracle of the whole product.

A deterministic DDP training (sbatch-examples/tiny_gpt.py on ElasticTrainer)
with 3 active nodes and hot spares; nodes or rank processes die mid-run; the
survivors keep their processes and memory, a spare receives the full state
from a data-parallel replica and takes the lost logical rank. The final model
and optimizer state must be bitwise equal to the fault-free run's
(``reference_hash``), and ``tp report`` must count every fault as resolved by
live migration with no committed step lost.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest

from scripts.devcluster import Cluster, wait_for
from tests.cluster.jobs import TRAIN_ARGS, TpJob, active_victim, final_hash, kill_rank, submit

pytestmark = pytest.mark.cluster


def migrations_done(job: TpJob) -> list[dict]:
    return [e for e in job.events() if e["kind"] == "migration_done"]


def wait_migrated(job: TpJob, count: int, timeout: float = 180) -> None:
    wait_for(
        lambda: len(migrations_done(job)) >= count,
        timeout=timeout,
        what=f"{count} migration(s) of job {job.job_id} done",
        interval=1,
    )


def report(c: Cluster, job: TpJob) -> dict:
    return json.loads(c.exec("ctl", "tp", "report", job.job_id, "--json").stdout)


def assert_all_live(c: Cluster, job: TpJob, faults: int, recoveries: int | None = None) -> None:
    """Every one of ``faults`` faults was resolved live with no committed step lost, in
    ``recoveries`` migrations (one per fault unless a fault fell into a recovery and folded
    into its next epoch)."""
    done = migrations_done(job)
    assert [d["resolution"] for d in done] == ["live"] * (faults if recoveries is None else recoveries), done
    assert all(d["lost_steps"] == 0 for d in done), done
    assert not [e for e in job.events() if e["kind"] == "restarted"]
    summary = report(c, job)["summary"]
    assert summary["faults"] == faults and summary["no_lost_progress"] == faults, summary
    assert summary["by_resolution"]["live"]["faults"] == faults, summary
    noun = "fault" if faults == 1 else "faults"
    assert (
        f"{faults} of {faults} {noun} resolved by live migration with 0 committed steps lost"
        in summary["text"]
    ), summary


def two_faults(c: Cluster, job: TpJob, inject: Callable[[str], None]) -> tuple[str, str]:
    """Inject a fault on an active node, wait for its migration, then on another; the nodes."""
    job.wait_step(5)
    first = active_victim(c, job)
    inject(first)
    wait_migrated(job, 1)
    job.wait_step(job.last_step() + 2)
    second = active_victim(c, job)
    assert second != first
    inject(second)
    assert c.wait_job_done(job.job_id, timeout=300) == "COMPLETED"
    return first, second


def test_two_node_kills_migrate_live_with_bitwise_equal_state(
    healthy_cluster: Cluster, reference_hash: str
) -> None:
    c = healthy_cluster
    job = submit(c, "-N", "3", "--spares", "2")
    first, second = two_faults(c, job, c.kill)
    assert c.job_field(job.job_id, "Restarts") == "0"
    promoted = [(e["replaces"], e["mode"]) for e in job.events() if e["kind"] == "spare_promoted"]
    assert promoted == [(first, "live"), (second, "live")]
    assert_all_live(c, job, 2)
    transfers = [e for e in job.events() if e["kind"] == "transfer_done"]
    assert len(transfers) == 2 and all(t["bytes"] > 1_000_000 for t in transfers), transfers
    assert all(t["sealed"] is True for t in transfers), "every transfer under tp run carries the job's MAC"
    assert final_hash(job) == reference_hash


def test_two_rank_kills_migrate_live_with_bitwise_equal_state(
    healthy_cluster: Cluster, reference_hash: str
) -> None:
    c = healthy_cluster
    job = submit(c, "-N", "3", "--spares", "2")
    first, second = two_faults(c, job, lambda node: kill_rank(c, node))
    blamed = [
        e["node"] for e in job.events() if e["kind"] == "step_exited" and e.get("exit_code") not in (0, None)
    ]
    assert blamed == [first, second], job.events()
    assert_all_live(c, job, 2)
    assert final_hash(job) == reference_hash


def test_corrupted_chunk_is_fetched_again(healthy_cluster: Cluster, reference_hash: str) -> None:
    c = healthy_cluster
    job = submit(c, "-N", "3", "--spares", "1", env={"TORCHPASS_TEST_CORRUPT_CHUNKS": "0"})
    job.wait_step(5)
    c.kill(active_victim(c, job))
    assert c.wait_job_done(job.job_id, timeout=300) == "COMPLETED"
    transfers = [e for e in job.events() if e["kind"] == "transfer_done"]
    assert len(transfers) == 1 and transfers[0]["retries"] == 1, transfers
    assert_all_live(c, job, 1)
    assert final_hash(job) == reference_hash


def test_admin_drain_moves_the_job_to_a_spare_and_frees_the_node(
    healthy_cluster: Cluster, reference_hash: str
) -> None:
    c = healthy_cluster
    job = submit(c, "-N", "3", "--spares", "1")
    job.wait_step(5)
    node = active_victim(c, job)
    c.exec("ctl", "scontrol", "update", f"nodename={node}", "state=drain", "reason=maintenance window")
    wait_for(
        lambda: c.node_states()[node] == "drained",
        timeout=120,
        what=f"{node} DRAINED (released by the job)",
        interval=2,
    )
    assert (
        node
        not in c.exec(
            "ctl", "scontrol", "show", "hostnames", c.job_field(job.job_id, "NodeList")
        ).stdout.split()
    )
    assert c.wait_job_done(job.job_id, timeout=300) == "COMPLETED"
    events = job.events()
    started = [e for e in events if e["kind"] == "migration_started"]
    assert len(started) == 1 and started[0]["mode"] == "planned", events
    done = migrations_done(job)
    assert [(d["resolution"], d["lost_steps"], d["recomputed_steps"]) for d in done] == [("live", 0, 0)], done
    assert [e["released"] for e in events if e["kind"] == "node_released"] == [True]
    assert not [e for e in events if e["kind"] in ("heartbeat_lost", "rank_hung", "node_down", "restarted")]
    assert final_hash(job) == reference_hash


def slow_steps(seconds: float) -> tuple[str, ...]:
    """TRAIN_ARGS with a longer sleep per step: the same training (the same final state), more
    time around a fault."""
    args = list(TRAIN_ARGS)
    args[args.index("--step-sleep") + 1] = str(seconds)
    return tuple(args)


def test_a_partitioned_node_migrates_live_and_is_fenced_when_it_comes_back(
    healthy_cluster: Cluster, reference_hash: str
) -> None:
    c = healthy_cluster
    job = submit(c, "-N", "3", "--spares", "1", train_args=slow_steps(1.0))
    job.wait_step(5)
    victim = active_victim(c, job)
    c.partition(victim)
    wait_migrated(job, 1)
    c.heal(victim)  # its old rank still runs, in the old epoch, and reconnects
    wait_for(
        lambda: [e for e in job.events() if e["kind"] == "fenced"],
        timeout=60,
        what=f"the old rank on {victim} fenced",
        interval=1,
    )
    assert c.wait_job_done(job.job_id, timeout=300) == "COMPLETED"
    events = job.events()
    (lost,) = [e for e in events if e["kind"] == "heartbeat_lost"]
    assert (lost["node"], lost["evidence"]) == (victim, "probe"), lost
    started = [e for e in events if e["kind"] == "migration_started"]
    assert [(s["mode"], s["failed"]) for s in started] == [("live", [victim])], started
    # it was heard again, once, and that moved nothing
    fenced = [(e["node"], e["sender"]) for e in events if e["kind"] == "fenced"]
    assert fenced == [(victim, f"{victim}/0")], events
    assert_all_live(c, job, 1)
    assert final_hash(job) == reference_hash


def test_a_node_cut_off_for_40_s_is_replaced_live_and_its_rank_leaves_alone(
    healthy_cluster: Cluster, reference_hash: str
) -> None:
    """No split brain (issue 22): the cut-off rank loses its supervisor for longer than its
    grace (15 s) but reads the supervisor's fresh lease in the run folder, so it leaves alone:
    it neither cancels the job nor records a supervisor loss."""
    c = healthy_cluster
    job = submit(c, "-N", "3", "--spares", "1", train_args=slow_steps(2.0))
    job.wait_step(3)
    victim = active_victim(c, job)
    c.partition(victim)
    cut = time.monotonic()
    wait_migrated(job, 1)

    # the old rank gives up on its supervisor and leaves while still cut off (its log line
    # cannot reach the job's output: srun collects it over the cut network)
    def left() -> bool:
        return c.exec(victim, "pgrep", "-f", "sbatch-examples/tiny_gpt.py", check=False).returncode == 1

    wait_for(left, timeout=max(1.0, 40 - (time.monotonic() - cut)), what=f"the cut-off rank on {victim} gone")
    time.sleep(max(0.0, 40 - (time.monotonic() - cut)))
    c.heal(victim)
    assert c.wait_job_done(job.job_id, timeout=300) == "COMPLETED"
    assert not (job.host_run_dir / ".torchpass" / "supervisor-lost.json").exists()
    out = job.output()
    assert "its status is" not in out, out[-3000:]  # the orphan's "it is gone; ending the job"
    doc = report(c, job)
    assert doc.get("supervisor_lost") is None and not [j for j in doc.get("jobs", []) if j["supervisor_lost"]]
    text = c.exec("ctl", "tp", "report", job.job_id).stdout
    assert "supervisor was lost" not in text, text
    assert_all_live(c, job, 1)
    assert final_hash(job) == reference_hash


def test_a_hung_rank_is_replaced_live(healthy_cluster: Cluster, reference_hash: str) -> None:
    c = healthy_cluster
    job = submit(c, "-N", "3", "--spares", "1")
    job.wait_step(5)
    victim = active_victim(c, job)
    c.exec(victim, "pkill", "-STOP", "-f", "python3 /src/sbatch-examples/tiny_gpt.py")
    wait_migrated(job, 1)
    c.exec(victim, "pkill", "-CONT", "-f", "python3 /src/sbatch-examples/tiny_gpt.py", check=False)
    assert c.wait_job_done(job.job_id, timeout=300) == "COMPLETED"
    events = job.events()
    (lost,) = [e for e in events if e["kind"] == "heartbeat_lost"]
    # silent while the job makes no progress: "progress", seconds before the heartbeat timeout;
    # frozen inside on_commit (a checkpoint), where progress is not judged: "timeout"
    assert lost["node"] == victim and lost["evidence"] in ("progress", "timeout"), lost
    assert_all_live(c, job, 1)
    assert final_hash(job) == reference_hash


def test_a_rank_stuck_in_python_that_still_heartbeats_is_replaced_live(
    healthy_cluster: Cluster, reference_hash: str
) -> None:
    c = healthy_cluster
    job = submit(c, "-N", "3", "--spares", "1", train_args=(*TRAIN_ARGS, "--hang-on-sigusr1"))
    job.wait_step(5)
    victim = active_victim(c, job)
    c.exec(victim, "pkill", "-USR1", "-f", "python3 /src/sbatch-examples/tiny_gpt.py")
    wait_migrated(job, 1)
    assert c.wait_job_done(job.job_id, timeout=300) == "COMPLETED"
    events = job.events()
    (hung,) = [e for e in events if e["kind"] == "rank_hung"]
    assert (hung["node"], hung["evidence"]) == (victim, "progress"), hung
    assert not [e for e in events if e["kind"] == "heartbeat_lost"], events  # it never went silent
    assert_all_live(c, job, 1)
    assert final_hash(job) == reference_hash
