"""The two dev-cluster flavors never share a name, an address or a folder, and an unknown
flavor is refused with the valid ones listed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from scripts import devcluster as dc

ROOT = Path(__file__).resolve().parents[3]


def test_flavors_differ_in_every_name_address_and_folder() -> None:
    trixie, bookworm = dc.FLAVORS["trixie"], dc.FLAVORS["bookworm"]
    for field in ("project", "image", "network", "net_prefix", "shared", "system_image"):
        assert getattr(trixie, field) != getattr(bookworm, field), field
    assert bookworm.wheels is not None and (dc.DOCKER_DIR / bookworm.wheels).exists()
    for flavor in dc.FLAVORS.values():
        assert flavor.system_dockerfile.exists()
        assert (dc.DOCKER_DIR / flavor.cgroup_conf).exists()


def test_the_bookworm_wheels_are_pinned() -> None:
    lines = (dc.DOCKER_DIR / dc.FLAVORS["bookworm"].wheels).read_text().splitlines()  # type: ignore[operator]
    reqs = [line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()]
    assert reqs and all("==" in r for r in reqs)
    assert "torch==2.13.0" in reqs


def test_an_unknown_flavor_is_refused_with_the_valid_ones() -> None:
    proc = subprocess.run(
        [sys.executable, "scripts/cluster", "status"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, TP_CLUSTER_FLAVOR="sid"),
    )
    assert proc.returncode != 0
    assert "TP_CLUSTER_FLAVOR='sid' is not a cluster flavor; valid: trixie, bookworm" in proc.stderr
