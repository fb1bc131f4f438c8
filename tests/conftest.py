"""Test layers: tests/unit (no Docker, fast) and tests/cluster (real Slurm in Docker).

Cluster tests carry the ``cluster`` marker. Outside CI they are skipped, with
the reason shown, when Docker does not answer; with ``CI=true`` a missing
Docker is an error, so a CI run can never pass without them.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def docker_problem() -> str | None:
    """Why the Docker engine cannot be used, or None when it can."""
    if shutil.which("docker") is None:
        return "docker is not installed"
    try:
        proc = subprocess.run(
            ["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        return "`docker info` did not answer within 30 s"
    if proc.returncode != 0:
        return f"the Docker engine does not answer: {proc.stderr.strip()[:200]}"
    return None


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cluster_items = [i for i in items if i.get_closest_marker("cluster")]
    if not cluster_items:
        return
    problem = docker_problem()
    if problem is None:
        return
    if in_ci():
        raise pytest.UsageError(
            f"CI=true but the cluster tests cannot run: {problem}. "
            ".ci/run installs docker.io and starts dockerd; see docs/dev-cluster.md."
        )
    skip = pytest.mark.skip(reason=f"cluster tests need Docker ({problem}); CI runs them")
    for item in cluster_items:
        item.add_marker(skip)
