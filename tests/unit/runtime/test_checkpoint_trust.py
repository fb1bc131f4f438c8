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


@pytest.mark.parametrize(
    "where, bits, who",
    [
        ("folder", stat.S_IWGRP, "its group"),
        ("folder", stat.S_IWOTH, "others"),
        ("step", stat.S_IWGRP | stat.S_IWOTH, "its group and others"),
        ("metadata", stat.S_IWGRP, "its group"),
        ("data", stat.S_IWOTH, "others"),
    ],
)
def test_a_checkpoint_writable_by_others_is_refused(tmp_path: Path, where: str, bits: int, who: str) -> None:
    directory, state = saved(tmp_path)
    step = checkpoint.step_dir(directory, 3)
    target = {
        "folder": directory,
        "step": step,
        "metadata": step / ".metadata",
        "data": next(step.glob("*.distcp")),
    }[where]
    add_mode(target, bits)
    with pytest.raises(CheckpointError) as refused:
        checkpoint.load_latest(state, directory)
    text = str(refused.value)
    assert f"refusing to load from {target}: it is writable by {who} (" in text
    assert "unpickles its metadata" in text and f"chmod -R go-w {target}" in text
    assert torch.equal(state["w"], torch.zeros(4)), "the state was loaded anyway"


def test_a_checkpoint_owned_by_another_user_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
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


@pytest.mark.parametrize("theirs", [True, False])
def test_a_symbolic_link_inside_a_checkpoint_is_refused(tmp_path: Path, theirs: bool) -> None:
    """Even to a private file: the load must not leave the folder it checked."""
    directory, state = saved(tmp_path)
    metadata = checkpoint.step_dir(directory, 3) / ".metadata"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(metadata.read_bytes())
    if theirs:
        add_mode(elsewhere, stat.S_IWOTH)
    metadata.unlink()
    metadata.symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match=f"refusing to load from {metadata}: it is a symbolic link"):
        checkpoint.load_latest(state, directory)


def test_a_folder_above_that_others_can_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    directory, state = saved(shared)
    add_mode(shared, stat.S_IWOTH)  # not sticky: anyone may rename ckpt/ away and put theirs there
    with pytest.raises(CheckpointError, match=f"the folder {shared} above it is writable by others"):
        checkpoint.load_latest(state, directory)
    os.chmod(shared, 0o1777)  # sticky, as /tmp: others cannot rename what is not theirs
    assert checkpoint.load_latest(state, directory) == 3


class _Planted:
    """Unpickling this writes a marker file: the attacker's code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


RACE_S = float(os.environ.get("TP_CHECKPOINT_RACE_S", "60"))


def test_a_checkpoint_swapped_in_a_loop_never_loads_the_planted_one(tmp_path: Path) -> None:
    """A racer swaps the checked step folder with a planted one (its pickled metadata writable
    by others) as fast as it can, for RACE_S seconds, while the loader loads in a loop: every
    load either refuses or loads the real checkpoint, and the planted metadata never runs."""
    import pickle
    import shutil
    import threading
    import time

    directory, state = saved(tmp_path)
    step = checkpoint.step_dir(directory, 3)
    planted, parked, marker = tmp_path / "planted", directory / "parked", tmp_path / "pwned"
    shutil.copytree(step, planted)
    (planted / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    add_mode(planted / ".metadata", stat.S_IWOTH)
    stop = threading.Event()

    def racer() -> None:
        while not stop.is_set():
            os.rename(step, parked)
            os.rename(planted, step)
            os.rename(step, planted)
            os.rename(parked, step)

    thread = threading.Thread(target=racer, daemon=True)
    thread.start()
    loads = refusals = 0
    deadline = time.monotonic() + RACE_S
    try:
        while time.monotonic() < deadline:
            state["w"] = torch.zeros(4)
            try:
                if checkpoint.load_latest(state, directory) == 3:
                    loads += 1
                    assert torch.equal(state["w"], torch.arange(4.0))
            except CheckpointError:
                refusals += 1
            assert not marker.exists(), "the planted metadata was unpickled"
    finally:
        stop.set()
        thread.join(5)
    print(f"{loads} loads and {refusals} refusals in {RACE_S:g} s of swapping")
    assert loads > 0 and refusals > 0, (loads, refusals)


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
    with pytest.raises(
        CheckpointError, match=f"refusing to load from {directory}: it is writable by its group"
    ):
        checkpoint.save({"w": torch.zeros(1)}, directory, step=1)
