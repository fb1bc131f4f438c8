"""A hostile peer outside the job, on the cluster's network, during a training (issues 11, 22).

A node that is not in the job's allocation sends garbage, truncated and
oversized frames, forged control messages (over plain ZMTP and over CURVE
with made-up keys), pre-claimed routing ids and connection floods to the
supervisor's control port while the job trains (``hostile_peer.py``). The
job must finish with the final state bitwise equal to the fault-free run's,
with no fault detected and no restart, and the supervisor's log (in the job's
output) must show the refusals. The same peer, speaking torch's store
protocol too, attacks the job's rendezvous store while a node dies, so that
the next epoch's group meets under attack.
"""

from __future__ import annotations

import json
import re
import threading
import time

import pytest

from scripts.devcluster import Cluster
from tests.cluster.conftest import COMPUTE
from tests.cluster.jobs import TpJob, active_victim, final_hash, submit

pytestmark = pytest.mark.cluster

PEER = "/src/tests/cluster/hostile_peer.py"
#: How long the peer attacks (the training takes about 10 s of steps after this starts).
ATTACK_S = 8
_CONTROL = re.compile(r"TORCHPASS_CONTROL=tcp://([^:\x00]+):(\d+)")
_STORE = re.compile(r"TORCHPASS_STORE=([^:\x00]+):(\d+)")


def rank_endpoint(c: Cluster, job: TpJob, pattern: re.Pattern[str] = _CONTROL) -> tuple[str, int]:
    """An endpoint of the job (the control plane's, or the store's) as its ranks were given it."""
    node = c.tp_victim(job.job_id)
    env = c.exec(
        node, "sh", "-c", "cat /proc/$(pgrep -f 'python3 /src/sbatch-examples/tiny_gpt.py' | head -1)/environ"
    ).stdout
    m = pattern.search(env)
    assert m, f"no {pattern.pattern.split('=')[0]} in the environment of the training on {node}"
    return m.group(1), int(m.group(2))


def outside(c: Cluster, job: TpJob) -> str:
    """A compute node the job does not hold (else the login node)."""
    held = set(c.job_nodes(job.job_id))
    return next((n for n in COMPUTE if n not in held), "ctl")


def test_a_hostile_peer_outside_the_job_changes_nothing(
    healthy_cluster: Cluster, reference_hash: str
) -> None:
    c = healthy_cluster
    job = submit(c, "-N", "3", "--spares", "1")
    job.wait_step(3)
    host, port = rank_endpoint(c, job)
    attacker = outside(c, job)
    sent = json.loads(c.exec(attacker, "python3", PEER, host, str(port), str(ATTACK_S), timeout=120).stdout)
    assert sent["raw"] > 0 and sent["flood"] > 0, sent
    assert c.wait_job_done(job.job_id, timeout=300) == "COMPLETED"
    kinds = job.kinds()
    assert kinds[-1] == "finished", kinds
    faults = [
        k
        for k in kinds
        if k in ("heartbeat_lost", "rank_hung", "node_down", "restarted", "migration_started")
    ]
    assert not faults, job.events()
    assert final_hash(job) == reference_hash
    log = job.output()
    assert "refused a control-plane connection" in log, log[-3000:]
    assert "dropped control message" not in log  # nothing forged got past CURVE to the decoder


def test_garbage_and_forged_store_traffic_during_a_live_migration_changes_nothing(
    healthy_cluster: Cluster, reference_hash: str
) -> None:
    c = healthy_cluster
    job = submit(c, "-N", "3", "--spares", "1")
    job.wait_step(3)
    host, port = rank_endpoint(c, job, _STORE)
    attacker = outside(c, job)
    sent: dict[str, int] = {}

    def attack() -> None:
        argv = ("python3", PEER, host, str(port), str(ATTACK_S), "--store")
        sent.update(json.loads(c.exec(attacker, *argv, timeout=150).stdout))

    thread = threading.Thread(target=attack, daemon=True)
    thread.start()
    time.sleep(2)  # the attack is under way: the next epoch's group meets during it
    victim = active_victim(c, job)
    c.kill(victim)
    thread.join(180)
    assert sent["store_written"] == 0 and sent["store_refused"] > 0 and sent["raw"] > 0, sent
    assert c.wait_job_done(job.job_id, timeout=300) == "COMPLETED"
    done = [e for e in job.events() if e["kind"] == "migration_done"]
    assert [(d["resolution"], d["lost_steps"]) for d in done] == [("live", 0)], job.events()
    assert not [e for e in job.events() if e["kind"] == "restarted"]
    assert final_hash(job) == reference_hash
    log = job.output()
    assert "refused a store connection" in log, log[-3000:]
