"""The bookworm cluster runs Slurm 22.05 and FSDP2 across its nodes: the ground every sharded
cluster test stands on."""

from __future__ import annotations

import re

import pytest

from scripts.devcluster import Cluster

pytestmark = pytest.mark.cluster

PROBE = "/src/tests/cluster_sharded/fsdp_probe.py"


def test_the_nodes_run_slurm_22_05(cluster: Cluster) -> None:
    out = cluster.exec("ctl", "sinfo", "--version").stdout
    assert re.match(r"slurm(-wlm)? 22\.05\.", out.strip()), out


def test_fsdp2_shards_a_2x2_mesh_over_four_nodes(healthy_cluster: Cluster) -> None:
    rendezvous = (
        "export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1) "
        f"MASTER_PORT=29517; exec python3 {PROBE}"
    )
    out = healthy_cluster.exec(
        "ctl", "srun", "-N4", "-n4", "--time=3", "bash", "-c", rendezvous, timeout=180
    ).stdout
    lines = re.findall(
        r"^probe rank=(\d) coord=\((\d), (\d)\) local=\[32, 64\] torch=2\.13\.\S+$", out, re.MULTILINE
    )
    assert sorted(lines) == [("0", "0", "0"), ("1", "0", "1"), ("2", "1", "0"), ("3", "1", "1")], out
