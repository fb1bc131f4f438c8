"""The session-wide cluster fixture: start the cluster, or reuse one already up.

What the fixture started it removes at the end of the session, whatever the
outcome; a cluster that was already up is left as it was found (minus any
faults a test injected, which every test repairs).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from tests.cluster.harness import COMPUTE, SCRIPT, Cluster, shared_dir, wait_for
from tests.cluster.jobs import final_hash, submit


def _cluster_running() -> bool:
    proc = subprocess.run(["docker", "exec", "torchpass-ctl", "sinfo", "-h", "-o", "%N"],
                          capture_output=True, text=True, timeout=60)
    return proc.returncode == 0


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    started = False
    if not _cluster_running():
        proc = subprocess.run([str(SCRIPT), "up"], text=True, timeout=3600)
        if proc.returncode != 0:
            subprocess.run([str(SCRIPT), "down"], timeout=300)
            pytest.fail("scripts/cluster up failed (output above)")
        started = True
    c = Cluster(shared_host=shared_dir())
    try:
        c.ensure_healthy()
        yield c
    finally:
        if started:
            subprocess.run([str(SCRIPT), "down"], timeout=300)


@pytest.fixture
def healthy_cluster(cluster: Cluster) -> Iterator[Cluster]:
    """The cluster with every compute node idle before and after the test."""
    cluster.ensure_healthy()
    try:
        yield cluster
    finally:
        cluster.ensure_healthy()


@pytest.fixture(scope="session")
def reference_hash(cluster: Cluster) -> str:
    """The fault-free run: 3 active nodes + 1 spare; also the 'done when' of tp-submit."""
    cluster.ensure_healthy()
    job = submit(cluster, "-N", "3", "--spares", "1")
    wait_for(lambda: job.host_run_dir.joinpath("status.json").exists() and
             all(n["state"] in ("running", "standby") for n in job.status()["nodes"]),
             timeout=120, what="every step up")
    allocated = cluster.exec("ctl", "scontrol", "show", "hostnames",
                             cluster.job_field(job.job_id, "NodeList")).stdout.split()
    assert len(allocated) == 4
    roles = sorted(n["role"] for n in job.status()["nodes"])
    assert roles == ["active", "active", "active", "spare"]
    assert cluster.wait_job_done(job.job_id, timeout=300) == "COMPLETED"
    kinds = job.kinds()
    assert kinds[0] == "started" and kinds[-1] == "finished"
    assert "restarted" not in kinds
    return final_hash(job)


__all__ = ["cluster", "healthy_cluster", "reference_hash", "COMPUTE"]
