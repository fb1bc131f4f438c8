"""The per-job secret that authenticates every control-plane message.

Life of the secret:

1. ``tp-submit`` calls :func:`create_secret` on the run directory: it makes
   ``RUN_DIR/.torchpass`` (mode 0700) and, inside it, the file ``secret``
   (mode 0600, created with ``O_CREAT|O_EXCL`` so it is never readable by
   anyone else, not even for an instant) holding 32 random bytes as hex.
2. The path goes to every process in ``TORCHPASS_SECRET_FILE`` (never the
   secret itself, never on a command line).
3. The supervisor and each rank call :func:`load_secret`, which refuses a file
   that others could read or write, that is not a regular file, or that does
   not hold exactly 64 hex digits.

The run directory lives on a shared file system, so file permissions are the
whole protection of the secret at rest; see ``docs/protocol.md``.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

from torchpass_slurm.errors import AuthenticationError, ControlPlaneError

__all__ = ["SECRET_DIR", "SECRET_NAME", "SECRET_BYTES", "create_secret", "load_secret"]

logger = logging.getLogger(__name__)

#: Folder under the run directory that holds the secret (mode 0700).
SECRET_DIR = ".torchpass"
#: File name of the secret inside :data:`SECRET_DIR` (mode 0600).
SECRET_NAME = "secret"
#: Size of the secret in bytes (stored as twice as many hex digits).
SECRET_BYTES = 32
#: A secret file larger than this is not read at all.
_MAX_FILE_BYTES = 1024


def create_secret(run_dir: Path) -> Path:
    """Create a new secret for the run in ``run_dir`` and return its path.

    Reuses ``run_dir/.torchpass`` if it exists (tightening its mode to 0700),
    but never an existing secret file: one run, one secret.
    """
    folder = Path(run_dir) / SECRET_DIR
    _make_private_dir(folder)
    path = folder / SECRET_NAME
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise ControlPlaneError(
            f"a control-plane secret already exists at {path}",
            hint="each run gets its own secret: use a fresh run directory, or delete the old "
            "secret if no job of that run is still alive",
        ) from None
    except OSError as exc:
        raise ControlPlaneError(f"cannot create the secret file {path}: {exc.strerror}") from None
    try:
        os.fchmod(fd, 0o600)  # the umask may only have removed bits; make it exact
        _write_all(fd, (secrets.token_hex(SECRET_BYTES) + "\n").encode("ascii"))
        os.fsync(fd)
    except OSError as exc:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise ControlPlaneError(f"cannot write the secret file {path}: {exc.strerror}") from None
    os.close(fd)
    logger.info("created the control-plane secret %s", path)
    return path


def load_secret(path: Path) -> bytes:
    """Read the secret at ``path`` and return its raw bytes.

    Raises AuthenticationError if the file is not private to its owner (any
    group/other permission bit, another owner, not a regular file, a symlink),
    and ControlPlaneError if it cannot be read or does not hold 64 hex digits.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ControlPlaneError(
            f"cannot open the control-plane secret {path}: {exc.strerror}",
            hint="TORCHPASS_SECRET_FILE must name the file tp-submit created (not a symlink)",
        ) from None
    try:
        _check_private(path, os.fstat(fd))
        raw = os.read(fd, _MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    return _parse_secret(path, raw)


def _make_private_dir(folder: Path) -> None:
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(folder)
    except OSError as exc:
        raise ControlPlaneError(f"cannot create the secret folder {folder}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ControlPlaneError(f"{folder} exists but is not a directory (or is a symlink)")
    if st.st_uid != os.geteuid():
        raise AuthenticationError(
            f"the secret folder {folder} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()})",
            hint="use a run directory that you own",
        )
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(folder, 0o700)


def _check_private(path: Path, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise AuthenticationError(f"the control-plane secret {path} is not a regular file")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise AuthenticationError(
            f"the control-plane secret {path} has mode {mode:04o}: group or others may "
            "access it, so it is no longer secret",
            hint=f"the file must be 0600; start the run again with a new secret, or, if you "
            f"are sure nobody read it, `chmod 600 {path}`",
        )
    if st.st_uid != os.geteuid():
        raise AuthenticationError(
            f"the control-plane secret {path} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()})"
        )


def _parse_secret(path: Path, raw: bytes) -> bytes:
    text = raw.decode("ascii", errors="replace").strip()
    if len(raw) > _MAX_FILE_BYTES or len(text) != 2 * SECRET_BYTES:
        raise ControlPlaneError(
            f"the control-plane secret {path} is malformed: expected {2 * SECRET_BYTES} hex "
            f"digits, found {len(raw)} bytes"
        )
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise ControlPlaneError(
            f"the control-plane secret {path} is malformed: it is not hexadecimal"
        ) from None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
