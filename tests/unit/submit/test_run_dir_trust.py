"""Issue 22: a run folder only its owner controls. tp-submit refuses a run dir, or a folder
above it, that another user owns or can rename entries in: whoever can swap a file under
``checkpoints/`` between the job's check and its load runs code as the job's owner."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from torchpass_slurm.errors import SubmitError
from torchpass_slurm.submit.checks import check_run_dir

STRANGER = 54321
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make another user's folder")


@pytest.fixture
def base(tmp_path: Path) -> Path:
    tmp_path.chmod(0o755)
    return tmp_path


def test_a_new_run_dir_under_folders_of_its_own_is_accepted(base: Path) -> None:
    check_run_dir(str(base / "a" / "run"))
    (base / "empty").mkdir(mode=0o755)
    check_run_dir(str(base / "empty"))


def test_a_sticky_shared_folder_above_is_accepted(base: Path) -> None:
    shared = base / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # as /tmp: others cannot rename what is not theirs
    check_run_dir(str(shared / "run"))


@pytest.mark.parametrize(("mode", "who"), [(0o777, "every user"), (0o775, "the members of group")])
def test_a_folder_above_that_others_can_write_is_refused(base: Path, mode: int, who: str) -> None:
    shared = base / "shared"
    shared.mkdir()
    shared.chmod(mode)
    if mode == 0o775:
        os.chown(shared, -1, os.getegid() + 1)  # a group that is not this user's own
    with pytest.raises(SubmitError, match=f"the folder {shared} is drwxrwx.*: {who}"):
        check_run_dir(str(shared / "deeper" / "run"))


def test_an_empty_run_dir_open_to_others_is_refused(base: Path) -> None:
    run = base / "run"
    run.mkdir()
    run.chmod(0o777)
    with pytest.raises(SubmitError, match=f"the run dir {run} is drwxrwxrwx: every user can rename"):
        check_run_dir(str(run))


@as_root
@pytest.mark.parametrize(
    ("made", "checked", "what"),
    [
        ("run", "run", "the run dir"),  # an empty run dir of another user
        ("torchpass-runs", "torchpass-runs/train.sh-20261202-101010", "the folder"),  # the default's parent
    ],
)
def test_a_folder_of_another_user_is_refused(base: Path, made: str, checked: str, what: str) -> None:
    folder = base / made
    folder.mkdir(mode=0o755)
    os.chown(folder, STRANGER, STRANGER)
    with pytest.raises(SubmitError, match=f"{what} {folder} belongs to uid {STRANGER}, not to you"):
        check_run_dir(str(base / checked))
