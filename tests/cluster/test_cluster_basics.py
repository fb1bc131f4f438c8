"""The dockerized cluster does for real what the rest of the project relies on.

These are the ground truths of design.md, checked on every CI run: nodes come
up idle, jobs run, a killed node goes DOWN, a network cut makes a node stop
responding, and, in a ``--no-kill`` job with one ``srun --no-kill`` step per
node, a node's death takes only its own step.
"""

from __future__ import annotations

import subprocess
import time
import uuid
from pathlib import Path

import pytest

from scripts.devcluster import COMPUTE, PROJECT, SERVICE, Cluster, wait_for

pytestmark = pytest.mark.cluster

#: Slurm marks a silent node DOWN after SlurmdTimeout (30 s in docker/slurm.conf);
#: the controller pings nodes periodically, so allow a generous margin.
SLURMD_TIMEOUT_S = 30.0
DOWN_MARGIN_S = 60.0


def test_every_node_comes_up_idle(cluster: Cluster) -> None:
    names = subprocess.run(
        ["docker", "ps", "--filter", f"name=^{PROJECT}-", "--format", "{{.Names}}"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.split()
    names = [n for n in names if n.split("-", 1)[1] in ("ctl", *COMPUTE, *SERVICE)]
    assert sorted(names) == sorted([f"{PROJECT}-{n}" for n in ("ctl", *COMPUTE, *SERVICE)])
    assert cluster.node_states() == {n: "idle" for n in COMPUTE + SERVICE}
    partitions = cluster.exec("ctl", "sinfo", "-h", "-o", "%R %N").stdout.split("\n")
    assert sorted(p for p in partitions if p) == ["debug c[1-5]", "scavenger c[1-5]", "service s1"]


def test_three_node_batch_job_output_is_read_back(healthy_cluster: Cluster) -> None:
    tag = uuid.uuid4().hex[:8]
    job = healthy_cluster.sbatch(
        "-N", "3", "-o", f"/shared/basic-{tag}.out", "--wrap", "srun -l hostname | sort"
    )
    assert healthy_cluster.wait_job_done(job, timeout=120) == "COMPLETED"
    lines = healthy_cluster.read_shared(f"basic-{tag}.out").split()
    # `srun -l` prefixes every line with the task id: "0: c1" ...
    hosts = sorted(lines[1::2])
    assert lines[0::2] == ["0:", "1:", "2:"]
    assert len(set(hosts)) == 3 and set(hosts) <= set(COMPUTE)


def test_killed_node_is_reported_down(healthy_cluster: Cluster) -> None:
    started = time.monotonic()
    healthy_cluster.kill("c2")
    state = wait_for(
        lambda: (s := healthy_cluster.node_states()["c2"]).startswith("down") and s,
        timeout=SLURMD_TIMEOUT_S + DOWN_MARGIN_S,
        what="c2 DOWN in sinfo",
        interval=2,
    )
    elapsed = time.monotonic() - started
    assert state == "down*", state  # '*': not responding, as after a power loss
    assert "DOWN" in healthy_cluster.node_json("c2")["state"]
    print(f"c2 reported DOWN {elapsed:.0f} s after the kill")


def test_partitioned_node_stops_responding_and_heal_brings_it_back(healthy_cluster: Cluster) -> None:
    healthy_cluster.partition("c4")
    wait_for(
        lambda: healthy_cluster.node_states()["c4"].endswith("*"),
        timeout=SLURMD_TIMEOUT_S + DOWN_MARGIN_S,
        what="c4 not responding",
        interval=2,
    )
    assert "NOT_RESPONDING" in healthy_cluster.node_json("c4")["state"]
    healthy_cluster.heal("c4")
    wait_for(
        lambda: healthy_cluster.node_states()["c4"] == "idle",
        timeout=SLURMD_TIMEOUT_S + DOWN_MARGIN_S,
        what="c4 idle again",
        interval=2,
    )


# Each step writes a start line, then a tick a second until the release file
# exists (the test creates it once it has seen what it came to see), then done.
STEP = (
    'd={dir}; n=$(hostname); echo "start $n" > $d/$n.out; i=0; '
    'while [ ! -e $d/release ] && [ $i -lt 240 ]; do i=$((i+1)); echo "tick $i" >> $d/$n.out; '
    'sleep 1; done; echo "done $n" >> $d/$n.out'
)
BATCH = """#!/bin/bash
for n in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
    srun --no-kill -N1 -n1 -w "$n" bash -c '{step}' &
done
wait
echo batch-finished > {dir}/batch.out
"""


def test_node_death_takes_only_its_own_no_kill_step(healthy_cluster: Cluster) -> None:
    c = healthy_cluster
    tag = uuid.uuid4().hex[:8]
    node_dir = f"/shared/nokill-{tag}"
    host_dir = c.shared_host / f"nokill-{tag}"
    host_dir.mkdir()
    script = BATCH.format(step=STEP.format(dir=node_dir), dir=node_dir)
    (host_dir / "job.sh").write_text(script)
    job = c.sbatch("-N", "3", "--no-kill", "-o", f"{node_dir}/slurm.out", f"{node_dir}/job.sh")
    try:
        _kill_one_node_mid_job(c, job, host_dir)
    finally:
        (host_dir / "release").touch()
        c.exec("ctl", "scancel", job, check=False)


def _kill_one_node_mid_job(c: Cluster, job: str, host_dir: Path) -> None:
    def started() -> list[str] | None:
        nodes = [n for n in COMPUTE if (host_dir / f"{n}.out").exists()]
        return nodes if len(nodes) == 3 else None

    nodes = wait_for(started, timeout=60, what="all three steps started")
    batch_host = c.job_field(job, "BatchHost")
    victim = next(n for n in nodes if n != batch_host)
    survivors = [n for n in nodes if n != victim]

    c.kill(victim)

    # Slurm marks the node DOWN and removes it from the job; the job keeps running.
    def job_nodes_without_victim() -> list[str] | None:
        job_nodes = c.job_nodes(job)
        return job_nodes if victim not in job_nodes else None

    job_nodes = wait_for(
        job_nodes_without_victim,
        timeout=SLURMD_TIMEOUT_S + DOWN_MARGIN_S,
        what=f"{victim} removed from job {job}",
        interval=2,
    )
    assert sorted(job_nodes) == sorted(survivors)
    assert c.job_field(job, "JobState") == "RUNNING"
    ticks = {n: _ticks(host_dir, n) for n in survivors}
    time.sleep(3)
    assert all(_ticks(host_dir, n) > ticks[n] for n in survivors), "surviving steps stopped"

    (host_dir / "release").touch()
    assert c.wait_job_done(job, timeout=60) == "COMPLETED"
    for n in survivors:
        assert (host_dir / f"{n}.out").read_text().splitlines()[-1] == f"done {n}"
    assert "done" not in (host_dir / f"{victim}.out").read_text()
    assert (host_dir / "batch.out").read_text().strip() == "batch-finished"


def _ticks(host_dir: Path, node: str) -> int:
    return sum(1 for line in (host_dir / f"{node}.out").read_text().splitlines() if line.startswith("tick"))
