"""tp run in tp-submit's heterogeneous job: the training nodes are component 1, reached with --het-group."""

from __future__ import annotations

import pytest

from torchpass_slurm.errors import ConfigError
from torchpass_slurm.supervisor.assemble import training_component


def test_a_plain_job_is_its_own_training_component() -> None:
    assert training_component(41, {"SLURM_JOB_ID": "41"}) == (41, ())


def test_the_het_group_names_the_component_and_its_srun_option() -> None:
    env = {
        "SLURM_JOB_ID": "7",
        "TORCHPASS_TRAINING_HET_GROUP": "1",
        "SLURM_JOB_ID_HET_GROUP_0": "7",
        "SLURM_JOB_ID_HET_GROUP_1": "8",
    }
    assert training_component(7, env) == (8, ("--het-group=1",))


def test_a_het_group_the_job_does_not_have_is_refused() -> None:
    with pytest.raises(
        ConfigError,
        match=r"TORCHPASS_TRAINING_HET_GROUP=1 but this job has no het "
        r"group 1 \(SLURM_JOB_ID_HET_GROUP_1=None\)",
    ):
        training_component(7, {"TORCHPASS_TRAINING_HET_GROUP": "1"})


def test_the_components_first_node_starts_as_the_last_spare() -> None:
    from torchpass_slurm.supervisor.assemble import _component_head_last

    assert _component_head_last(["c1", "c2", "c3", "c4"], "c1") == ["c2", "c3", "c4", "c1"]
    assert _component_head_last(["c1", "c2"], None) == ["c2", "c1"]
