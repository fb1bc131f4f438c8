"""The per-job secret file: created private, refused when it is not."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from torchpass_slurm.control.secret import SECRET_BYTES, create_secret, load_secret
from torchpass_slurm.errors import AuthenticationError, ControlPlaneError


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_create_then_load(tmp_path: Path) -> None:
    path = create_secret(tmp_path)
    assert path == tmp_path / ".torchpass" / "secret"
    assert mode(path) == 0o600 and mode(path.parent) == 0o700
    secret = load_secret(path)
    assert len(secret) == SECRET_BYTES
    assert path.read_text().strip() == secret.hex()


def test_each_run_gets_a_different_secret(tmp_path: Path) -> None:
    a = load_secret(create_secret(tmp_path / "a"))
    b = load_secret(create_secret(tmp_path / "b"))
    assert a != b


def test_private_even_under_a_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        path = create_secret(tmp_path)
    finally:
        os.umask(old)
    assert mode(path) == 0o600 and mode(path.parent) == 0o700


def test_existing_folder_is_reused_and_tightened(tmp_path: Path) -> None:
    (tmp_path / ".torchpass").mkdir(mode=0o755)
    os.chmod(tmp_path / ".torchpass", 0o755)
    path = create_secret(tmp_path)
    assert mode(path.parent) == 0o700


def test_existing_secret_is_never_overwritten(tmp_path: Path) -> None:
    path = create_secret(tmp_path)
    before = path.read_bytes()
    with pytest.raises(ControlPlaneError, match="already exists"):
        create_secret(tmp_path)
    assert path.read_bytes() == before


@pytest.mark.parametrize("bad_mode", [0o644, 0o640, 0o604, 0o620])
def test_readable_or_writable_by_others_is_refused(tmp_path: Path, bad_mode: int) -> None:
    path = create_secret(tmp_path)
    os.chmod(path, bad_mode)
    with pytest.raises(AuthenticationError, match=f"mode {bad_mode:04o}") as info:
        load_secret(path)
    assert path.read_text().strip() not in str(info.value)


@pytest.mark.parametrize(
    "content, match",
    [
        (b"", "malformed"),
        (b"abc\n", "malformed"),
        (b"zz" * SECRET_BYTES, "not hexadecimal"),
        (b"00" * (SECRET_BYTES + 1), "malformed"),
        (b"0" * 5000, "malformed"),
    ],
)
def test_malformed_content_is_refused(tmp_path: Path, content: bytes, match: str) -> None:
    path = tmp_path / "secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, content)
    os.close(fd)
    with pytest.raises(ControlPlaneError, match=match):
        load_secret(path)


def test_symlink_and_missing_file_are_refused(tmp_path: Path) -> None:
    real = create_secret(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(ControlPlaneError, match="cannot open"):
        load_secret(link)
    with pytest.raises(ControlPlaneError, match="cannot open"):
        load_secret(tmp_path / "missing")


def test_a_directory_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "d"
    folder.mkdir(mode=0o700)
    os.chmod(folder, 0o700)
    with pytest.raises(AuthenticationError, match="not a regular file"):
        load_secret(folder)
