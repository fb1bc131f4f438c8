"""Cluster tests of sharded training (FSDP2, HSDP): the bookworm dev cluster.

FSDP2 needs a newer torch than Debian's 2.6 in the trixie image, so these tests
run on the bookworm flavor of the dev cluster (Slurm 22.05, torch 2.13 from the
host's wheels; docs/dev-cluster.md). ``scripts/test`` runs this folder in its
own pytest process with ``TP_CLUSTER_FLAVOR=bookworm``; the cluster fixtures are
tests/cluster's, on that flavor.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts import devcluster
from tests.cluster.conftest import (  # noqa: F401 - the fixtures and the report hook, reused
    cluster,
    healthy_cluster,
    multi_chunk_reference,
    pytest_runtest_makereport,
)

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On another flavor these tests are skipped, saying how to run them (scripts/test does)."""
    if devcluster.FLAVOR.name == "bookworm":
        return
    skip = pytest.mark.skip(
        reason="runs on the bookworm dev cluster: TP_CLUSTER_FLAVOR=bookworm pytest tests/cluster_sharded"
    )
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(skip)
