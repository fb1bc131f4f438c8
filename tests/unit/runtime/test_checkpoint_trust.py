"""A checkpoint is only loaded from a folder nobody else could have written (issue 11, item 5).

torch.distributed.checkpoint unpickles a checkpoint's ``.metadata`` on every rank that loads it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torchpass_slurm.errors import CheckpointError  # noqa: E402
from torchpass_slurm.rank import checkpoint, trusted_dir  # noqa: E402


def saved(tmp_path: Path) -> tuple[Path, dict[str, object]]:
    directory = tmp_path / "ckpt"
    state = {"w": torch.arange(4.0)}
    checkpoint.save(state, directory, step=3)
    return directory, {"w": torch.zeros(4)}


def add_mode(path: Path, bits: int) -> None:
    os.chmod(path, stat.S_IMODE(os.stat(path).st_mode) | bits)


def test_a_private_checkpoint_loads(tmp_path: Path) -> None:
    directory, state = saved(tmp_path)
    assert checkpoint.load_latest(state, directory) == 3
    assert torch.equal(state["w"], torch.arange(4.0))


@pytest.mark.parametrize("where, bits, who", [
    ("folder", stat.S_IWGRP, "its group"),
    ("folder", stat.S_IWOTH, "others"),
    ("step", stat.S_IWGRP | stat.S_IWOTH, "its group and others"),
    ("metadata", stat.S_IWGRP, "its group"),
    ("data", stat.S_IWOTH, "others"),
])
def test_a_checkpoint_writable_by_others_is_refused(tmp_path: Path, where: str, bits: int, who: str) -> None:
    directory, state = saved(tmp_path)
    step = checkpoint.step_dir(directory, 3)
    target = {"folder": directory, "step": step, "metadata": step / ".metadata",
              "data": next(step.glob("*.distcp"))}[where]
    add_mode(target, bits)
    with pytest.raises(CheckpointError) as refused:
        checkpoint.load_latest(state, directory)
    text = str(refused.value)
    assert f"refusing to load from {target}: it is writable by {who} (" in text
    assert "unpickles its metadata" in text and f"chmod -R go-w {target}" in text
    assert torch.equal(state["w"], torch.zeros(4)), "the state was loaded anyway"


def test_a_checkpoint_owned_by_another_user_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory, state = saved(tmp_path)
    metadata = checkpoint.step_dir(directory, 3) / ".metadata"
    if os.geteuid() == 0:
        os.chown(metadata, 4242, -1)
        owner = "uid 4242"
    else:  # a user cannot give a file away: be someone else instead
        owner = f"uid {os.geteuid()}"
        monkeypatch.setattr(trusted_dir.os, "geteuid", lambda: 4242)
    with pytest.raises(CheckpointError, match=f"refusing to load from {metadata}: it is owned by {owner}"):
        checkpoint.load_latest(state, directory)


def test_a_link_to_someone_elses_file_is_refused_by_its_target(tmp_path: Path) -> None:
    directory, state = saved(tmp_path)
    metadata = checkpoint.step_dir(directory, 3) / ".metadata"
    elsewhere = tmp_path / "theirs"
    elsewhere.write_bytes(metadata.read_bytes())
    add_mode(elsewhere, stat.S_IWOTH)
    metadata.unlink()
    metadata.symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match="writable by others"):
        checkpoint.load_latest(state, directory)


def test_a_save_under_umask_002_is_still_loadable(tmp_path: Path) -> None:
    old = os.umask(0o002)
    try:
        directory, state = saved(tmp_path)
    finally:
        os.umask(old)
    modes = [os.stat(p).st_mode for p in [directory, *directory.rglob("*")]]
    assert not any(m & (stat.S_IWGRP | stat.S_IWOTH) for m in modes)
    assert checkpoint.load_latest(state, directory) == 3


def test_saving_into_a_shared_folder_fails_at_the_first_save(tmp_path: Path) -> None:
    directory = tmp_path / "shared"
    directory.mkdir()
    add_mode(directory, stat.S_IWGRP)
    with pytest.raises(CheckpointError, match=f"refusing to load from {directory}: it is writable by its group"):
        checkpoint.save({"w": torch.zeros(1)}, directory, step=1)
