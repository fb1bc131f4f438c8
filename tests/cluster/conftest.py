"""The session-wide cluster fixture: start the cluster, or reuse one already up.

The cluster is driven by scripts/devcluster.py, the same driver behind
``scripts/cluster`` and the benchmarks.

What the fixture started it removes at the end of the session, whatever the
outcome; a cluster that was already up is left as it was found (minus any
faults a test injected, which every test repairs).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from scripts.devcluster import COMPUTE, Cluster, ClusterError, wait_for
from tests.cluster.jobs import MULTI_CHUNK_ARGS, SUBMITTED, final_hash, post_mortem, submit

#: Where, in SUBMITTED, a test's own jobs begin (the session fixtures submit some first).
_FIRST_JOB = pytest.StashKey[int]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed cluster test carries its jobs' event logs and output tails in its report: on CI
    the run folders are gone once the run ends, and these are what says why a job failed."""
    outcome = yield
    report = outcome.get_result()
    if call.when == "setup":
        item.stash[_FIRST_JOB] = len(SUBMITTED)
    elif report.failed and call.when == "call":
        for job in SUBMITTED[item.stash.get(_FIRST_JOB, 0) :]:
            report.sections.append((f"tp job {job.job_id}", post_mortem(job)))


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    started = False
    if not c.is_up():
        try:
            c.up()
        except ClusterError as err:
            c.down()
            pytest.fail(f"the cluster did not come up: {err}")
        started = True
    try:
        c.ensure_healthy()
        yield c
    finally:
        if started:
            c.down()


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
    wait_for(
        lambda: (
            job.host_run_dir.joinpath("status.json").exists()
            and all(n["state"] in ("running", "standby") for n in job.status()["nodes"])
        ),
        timeout=120,
        what="every step up",
    )
    allocated = cluster.job_nodes(job.job_id)
    assert len(allocated) == 4
    roles = sorted(n["role"] for n in job.status()["nodes"])
    assert roles == ["active", "active", "active", "spare"]
    assert cluster.wait_job_done(job.job_id, timeout=300) == "COMPLETED"
    kinds = job.kinds()
    assert kinds[0] == "started" and kinds[-1] == "finished"
    assert "restarted" not in kinds
    return final_hash(job)


@pytest.fixture(scope="session")
def multi_chunk_reference(cluster: Cluster) -> str:
    """The fault-free run of :data:`~tests.cluster.jobs.MULTI_CHUNK_ARGS` (3 replicas): the
    reference of the tests that kill a donor mid-stream."""
    cluster.ensure_healthy()
    job = submit(cluster, "-N", "3", train_args=MULTI_CHUNK_ARGS)
    assert cluster.wait_job_done(job.job_id, timeout=300) == "COMPLETED"
    return final_hash(job)


__all__ = ["COMPUTE", "cluster", "healthy_cluster", "multi_chunk_reference", "reference_hash"]
