"""The SPANK plugin (--tp-spares) and job_submit.lua, loaded in the real cluster.

The plugin is built into the node image from spank/ and loaded through
docker/plugstack.conf; slurm.conf has JobSubmitPlugins=lua with
spank/job_submit.lua, which adds the spares to the node count.
"""

from __future__ import annotations

import json
import uuid

import pytest

from scripts.devcluster import Cluster, wait_for
from tests.cluster.jobs import DONE, EXAMPLE, TRAIN_ARGS

pytestmark = pytest.mark.cluster


def test_sbatch_srun_and_salloc_offer_tp_spares(cluster: Cluster) -> None:
    for command in ("sbatch", "srun", "salloc"):
        out = cluster.exec("ctl", command, "--help").stdout
        assert "--tp-spares" in out, f"{command} --help does not list --tp-spares"


def test_a_bad_value_is_refused_with_a_clear_message(healthy_cluster: Cluster) -> None:
    before = healthy_cluster.exec("ctl", "squeue", "-h", "-o", "%i").stdout
    for value in ("abc", "9"):  # not a number; above the plugstack max=4
        proc = healthy_cluster.exec("ctl", "sbatch", f"--tp-spares={value}", "--wrap", "true", check=False)
        assert proc.returncode != 0, proc
        assert "torchpass:" in proc.stderr, proc.stderr
    assert healthy_cluster.exec("ctl", "squeue", "-h", "-o", "%i").stdout == before


def test_tp_spares_on_plain_sbatch_reserves_the_nodes(healthy_cluster: Cluster) -> None:
    c = healthy_cluster
    tag = uuid.uuid4().hex[:8]
    job = c.sbatch(
        "-N",
        "2",
        "--tp-spares=1",
        "-o",
        f"/shared/spank-{tag}.out",
        "--wrap",
        "srun -l printenv TORCHPASS_SPARES | sort",
    )
    assert c.wait_job_done(job, timeout=120) == "COMPLETED"
    assert c.job_field(job, "NumNodes") == "3"
    assert c.read_shared(f"spank-{tag}.out").split() == ["0:", "1", "1:", "1", "2:", "1"]


def test_plain_sbatch_with_tp_spares_runs_tp_run_with_a_hot_spare(healthy_cluster: Cluster) -> None:
    """No tp-submit at all: sbatch --tp-spares, and tp run in the script finds its spare."""
    c = healthy_cluster
    run_dir = f"/shared/runs/spank-{uuid.uuid4().hex[:8]}"
    job = c.sbatch(
        "--tp-spares=1",
        f"--export=ALL,TORCHPASS_RUN_DIR={run_dir}",
        "-o",
        f"{run_dir}.out",
        EXAMPLE,
        *TRAIN_ARGS,
    )
    host_run_dir = c.shared_host / run_dir.removeprefix("/shared/")

    def roles() -> list[str] | None:
        if not (host_run_dir / "status.json").exists():
            return None
        status = json.loads((host_run_dir / "status.json").read_text())
        return sorted(n["role"] for n in status["nodes"])

    assert wait_for(roles, timeout=120, what="tp run's status") == ["active", "active", "active", "spare"]
    assert c.wait_job_done(job, timeout=300) == "COMPLETED"
    assert DONE.search(c.read_shared(f"{run_dir.removeprefix('/shared/')}.out"))
