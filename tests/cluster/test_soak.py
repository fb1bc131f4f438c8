"""No false detections: fault-free training with CPU hogs on the batch host and on a compute node.

The detectors declare a silent node lost after about a second once a second
signal confirms it, and a silence nothing confirms after ``heartbeat_timeout``.
This run loads the two places where a false positive would come from (the
supervisor's host and a rank's host), each with a busy loop competing for the
machine's cores, and checks that the event log holds no fault of any kind.

``TP_SOAK_SECONDS`` sets how long the training runs (default 120 s, the CI
run); ``TP_SOAK_SECONDS=600 scripts/test tests/cluster/test_soak.py`` is the
ten-minute soak. The steps are counted from the pace measured under the two
hogs (about 0.8 s a step, checkpoints every 4 steps included), and the job
asks Slurm for a time limit well past it: the example script's 10 minutes
ended a 600 s soak sized by its sleep alone (1,500 steps) at step 724.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator

import pytest

from scripts.devcluster import Cluster
from tests.cluster.jobs import TRAIN_ARGS, active_victim, submit

pytestmark = pytest.mark.cluster

SOAK_S = float(os.environ.get("TP_SOAK_SECONDS", "120"))
STEP_SLEEP_S = 0.4
#: Seconds a step takes under the two hogs (measured: 724 steps in 10 min, 2026-12-01).
LOADED_STEP_S = 0.8
#: Events that would mean something was declared wrong with a healthy job.
FAULT_KINDS = {
    "heartbeat_lost",
    "rank_hung",
    "node_down",
    "migration_started",
    "restarted",
    "fenced",
    "failed",
    "spare_lost",
    "drain_seen",
    "health_warning",
}
HOG = "exec python3 -c 'while True: pass'"


def train_args(seconds: float) -> tuple[str, ...]:
    """TRAIN_ARGS with as many steps as ``seconds`` of training take on the loaded hosts."""
    args = list(TRAIN_ARGS)
    args[args.index("--steps") + 1] = str(max(24, int(seconds / LOADED_STEP_S)))
    args[args.index("--step-sleep") + 1] = str(STEP_SLEEP_S)
    return tuple(args)


@pytest.fixture
def hog(healthy_cluster: Cluster) -> Iterator[Callable[[str], str]]:
    """``hog(node)`` starts a busy loop on the node (its pid); every one is killed at the end."""
    started: list[tuple[str, str]] = []

    def start(node: str) -> str:
        proc = healthy_cluster.exec(node, "sh", "-c", f'nohup sh -c "{HOG}" >/dev/null 2>&1 & echo $!')
        started.append((node, proc.stdout.strip()))
        return started[-1][1]

    yield start
    for node, pid in started:
        healthy_cluster.exec(node, "kill", "-9", pid, check=False)


def test_loaded_hosts_raise_no_false_detection(healthy_cluster: Cluster, hog: Callable[[str], str]) -> None:
    c = healthy_cluster
    minutes = math.ceil(SOAK_S * 4 / 60) + 2
    job = submit(c, "-N", "3", "--spares", "1", "--time", str(minutes), train_args=train_args(SOAK_S))
    job.wait_step(1)
    loaded = [c.job_field(job.job_id, "BatchHost"), active_victim(c, job)]
    pids = {node: hog(node) for node in loaded}
    assert c.wait_job_done(job.job_id, timeout=SOAK_S * 4 + 120) == "COMPLETED"
    for node, pid in pids.items():  # the load was there until the end
        assert c.exec(node, "kill", "-0", pid, check=False).returncode == 0, f"the hog on {node} died"
    events = job.events()
    faults = [
        e
        for e in events
        if e["kind"] in FAULT_KINDS or (e["kind"] == "step_exited" and e.get("exit_code") != 0)
    ]
    assert not faults, faults
    assert events[-1]["kind"] == "finished"
