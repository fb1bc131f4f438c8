"""The rendered batch script, checked against golden files.

To regenerate the golden files after an intended change, run

    TP_UPDATE_GOLDEN=1 pytest tests/unit/submit/test_render.py

and review the diff of ``tests/unit/submit/golden/`` before committing it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from torchpass_slurm.errors import SubmitError
from torchpass_slurm.submit import (
    JobSpec,
    check_partition_fits,
    render_batch_script,
    sbatch_arguments,
    sbatch_command_line,
)

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("TP_UPDATE_GOLDEN") == "1"

RUN_DIR = "/shared/runs/train-20250304-050607"

SCRIPT_SPEC = JobSpec(
    nodes=4,
    spares=2,
    ntasks_per_node=8,
    job_name="train",
    run_dir=RUN_DIR,
    secret_file=f"{RUN_DIR}/.torchpass/secret",
    source="jobs/train.sbatch",
    shebang="#!/bin/bash -l",
    body=(
        "#SBATCH -N 4\n"
        "#SBATCH --time=1:00:00\n"
        "#TP --spares=2\n"
        "\n"
        "module load pytorch\n"
        'tp run python train.py --config "$1"\n'
    ),
    script_args=("configs/big run.yaml",),
    partition="gpu",
    sbatch_passthrough=("--time=1:00:00", "--mail-type", "END"),
)

COMMAND_SPEC = JobSpec(
    nodes=2,
    spares=1,
    ntasks_per_node=1,
    job_name="python",
    run_dir="/home/u/my runs/r1",
    secret_file="/home/u/my runs/r1/.torchpass/secret",
    source="the command line",
    command=("python", "train.py", "--note", "it's $HOME"),
    output="logs/%j.out",
    chdir="/home/u/proj",
)


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; see the module docstring to regenerate"


def test_script_mode_golden() -> None:
    check_golden("script_mode.sh", render_batch_script(SCRIPT_SPEC))


def test_command_mode_golden() -> None:
    check_golden("command_mode.sh", render_batch_script(COMMAND_SPEC))


def test_rendering_is_pure() -> None:
    assert render_batch_script(SCRIPT_SPEC) == render_batch_script(SCRIPT_SPEC)


def test_script_without_trailing_newline_or_args() -> None:
    spec = JobSpec(
        nodes=1,
        spares=0,
        ntasks_per_node=1,
        job_name="j",
        run_dir="/r",
        secret_file="/r/s",
        source="j.sh",
        shebang="#!/bin/sh",
        body="tp run true",
    )
    assert render_batch_script(spec).endswith(
        "export TORCHPASS_SECRET_FILE=/r/s\n"
        "# ---- j.sh, without its #! line; its #SBATCH lines are inert here ----\n"
        "tp run true\n"
    )


def test_sbatch_arguments() -> None:
    assert sbatch_arguments(SCRIPT_SPEC) == (
        "--job-name=train",
        "--nodes=6",
        "--ntasks-per-node=8",
        "--no-kill",
        f"--output={RUN_DIR}/slurm-%j.out",
        f"--comment=torchpass:run_dir={RUN_DIR}",
        "--partition=gpu",
        "--time=1:00:00",
        "--mail-type",
        "END",
    )
    assert sbatch_command_line(COMMAND_SPEC) == (
        "sbatch --parsable --job-name=python --nodes=3 --ntasks-per-node=1 --no-kill "
        "--output=logs/%j.out '--comment=torchpass:run_dir=/home/u/my runs/r1' --chdir=/home/u/proj"
    )


def test_the_secret_is_never_on_the_command_line_or_in_the_script() -> None:
    for spec in (SCRIPT_SPEC, COMMAND_SPEC):
        text = render_batch_script(spec) + sbatch_command_line(spec)
        assert "TORCHPASS_SECRET=" not in text
        assert text.count(".torchpass/secret") == 1  # only its path, exported once


def test_partition_fits() -> None:
    check_partition_fits(SCRIPT_SPEC, "gpu", 6)
    check_partition_fits(SCRIPT_SPEC, "gpu", None)  # Slurm could not tell
    with pytest.raises(SubmitError) as info:
        check_partition_fits(SCRIPT_SPEC, "gpu", 5)
    assert info.value.message == (
        "the job needs 6 nodes (4 active + 2 hot spares), but partition 'gpu' has only 5 nodes"
    )
    assert info.value.hint == "lower --spares or -N, or pick a larger partition with -p"
    with pytest.raises(SubmitError, match="but the cluster has only 1 node\n"):
        check_partition_fits(COMMAND_SPEC, None, 1)
