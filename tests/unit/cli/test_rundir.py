"""find_run_dir: a run folder as given, or a job id through its comment or its stdout."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchpass_slurm.errors import RunDirError
from torchpass_slurm.rundir.locate import find_run_dir, run_dir_from_comment, run_dir_of_job
from torchpass_slurm.slurm import Job

from .conftest import scontrol_job


@pytest.mark.parametrize(
    ("comment", "found"),
    [
        (None, None),
        ("", None),
        ("my own words", None),
        ("torchpass:run_dir=/shared/runs/r1", Path("/shared/runs/r1")),
        ("torchpass:run_dir=/shared/my runs/r1 ", Path("/shared/my runs/r1")),
        ("team x; torchpass:run_dir=/r", Path("/r")),
        ("torchpass:run_dir=", None),
    ],
)
def test_run_dir_from_comment(comment: str | None, found: Path | None) -> None:
    assert run_dir_from_comment(comment) == found


def test_a_run_folder_is_used_as_it_is(run_dir: Path) -> None:
    assert find_run_dir(str(run_dir)) == run_dir
    (run_dir / "status.json").unlink()  # events.jsonl alone is enough
    assert find_run_dir(str(run_dir)) == run_dir


def test_an_ordinary_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RunDirError) as info:
        find_run_dir(str(tmp_path))
    assert info.value.message == (
        f"{tmp_path} is a folder but not a torchpass run folder (it has no status.json and no events.jsonl)"
    )


def test_nothing_given() -> None:
    with pytest.raises(RunDirError) as info:
        find_run_dir(" ")
    assert info.value.message == "no job id or run folder was given"


@pytest.mark.parametrize("given", ["12x", "-3", "١٢"])
def test_neither_folder_nor_job_id(given: str) -> None:
    with pytest.raises(RunDirError, match="is neither a folder nor a Slurm job id"):
        find_run_dir(given)


def test_job_id_through_the_comment(run_dir: Path, slurm_job) -> None:  # type: ignore[no-untyped-def]
    runner = slurm_job(scontrol_job(comment=f"torchpass:run_dir={run_dir}"))
    assert find_run_dir("1") == run_dir
    assert [call.argv for call in runner.calls] == [("scontrol", "-o", "show", "job", "1")]


def test_pending_job_whose_run_folder_is_still_empty(tmp_path: Path) -> None:
    job = Job(job_id=7, name="j", state="PENDING", comment=f"torchpass:run_dir={tmp_path}")
    assert run_dir_of_job(job) == tmp_path


def test_comment_naming_a_folder_this_host_lacks(tmp_path: Path) -> None:
    job = Job(job_id=7, name="j", state="RUNNING", comment=f"torchpass:run_dir={tmp_path}/gone")
    with pytest.raises(RunDirError) as info:
        run_dir_of_job(job)
    assert info.value.message == (
        f"job 7's comment names the run folder {tmp_path}/gone, which does not exist here"
    )


def test_job_id_through_the_stdout_folder(run_dir: Path, slurm_job) -> None:  # type: ignore[no-untyped-def]
    slurm_job(scontrol_job(comment="my own words", std_out=f"{run_dir}/slurm-1.out"))
    assert find_run_dir("1") == run_dir


def test_stdout_outside_a_run_folder_is_not_enough(tmp_path: Path) -> None:
    job = Job(job_id=1, name="j", state="RUNNING", std_out=f"{tmp_path}/slurm-1.out")
    with pytest.raises(RunDirError, match=r"^job 1 was not submitted with tp-submit"):
        run_dir_of_job(job)
