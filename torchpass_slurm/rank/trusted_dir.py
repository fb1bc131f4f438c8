"""Only load a checkpoint that nobody but its owner could have written.

torch.distributed.checkpoint unpickles the ``.metadata`` file of a checkpoint
(and pickled items in its data files) on every rank that loads it: whoever
can write into the checkpoint folder can make every rank run code of their
choice. So before loading, every path that the load reads must be

- owned by the user running the training (or by root), and
- not writable by group or others.

The same holds for the checkpoint folder itself: someone who may create
entries in it can put a ``step-<N>`` folder of their own there (which the
owner check then refuses) or rename ours away, and for every folder above it
(up to ``/``), where someone who may rename entries could swap the whole tree
between the check and the load: those may be shared only as homes are (a
sticky ``/tmp``, the user's own group; :func:`~torchpass_slurm.ownership.foreign`).

:func:`opened_tree` closes the gap between the check and the load: it opens
the step's folder once, checks it and everything below it through that open
handle (``fstat``, ``os.fwalk``, no symbolic link followed), and hands the
loader ``/proc/self/fd/N``, a path that reaches exactly the folder it
checked, whatever is renamed meanwhile.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torchpass_slurm.errors import CheckpointError
from torchpass_slurm.ownership import WRITABLE_BY_OTHERS, foreign, owner_name

__all__ = ["check_trusted", "check_parents", "opened_tree", "make_private"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def check_trusted(path: Path, st: os.stat_result | None = None) -> None:
    """Raise CheckpointError unless ``path`` (or its ``st``, already taken) is owned by this user
    (or root) and not group/other writable."""
    if st is None:
        try:
            st = os.stat(path)
        except OSError as exc:
            raise CheckpointError(f"cannot inspect the checkpoint path {path}: {exc}") from exc
    found = foreign(st)
    if found is None:
        return
    if found.owner is not None:
        raise CheckpointError(
            f"refusing to load from {path}: it is owned by {owner_name(found.owner)}, not by this user "
            f"({owner_name(os.geteuid())}); loading a checkpoint unpickles its metadata, so its author "
            "could run code on every rank",
            hint="checkpoint into a folder of your own (or copy the checkpoint there, reviewed)",
        )
    mode = stat.filemode(st.st_mode)
    raise CheckpointError(
        f"refusing to load from {path}: it is writable by {found.writers} ({mode}); loading a checkpoint "
        "unpickles its metadata, so anyone who can write there could run code on every rank",
        hint=f"if nobody else wrote into it: chmod -R go-w {path}; or checkpoint into a private folder",
    )


def check_parents(folder: Path) -> None:
    """CheckpointError unless no other user can rename an entry of a folder above ``folder``."""
    for parent in folder.parents:
        try:
            st = os.stat(parent)
        except OSError as exc:
            raise CheckpointError(f"cannot inspect the folder {parent} above the checkpoints: {exc}") from exc
        found = foreign(st, above=True)
        if found is None:
            continue
        who = owner_name(found.owner) if found.owner is not None else found.writers
        raise CheckpointError(
            f"refusing to load from {folder}: the folder {parent} above it is "
            f"{'owned by ' if found.owner is not None else 'writable by '}{who} "
            f"({stat.filemode(st.st_mode)}), who could swap the checkpoint between its check and its "
            "load; loading a checkpoint unpickles its metadata",
            hint="checkpoint under a folder of your own",
        )


@contextmanager
def opened_tree(root: Path, name: str) -> Iterator[Path]:
    """Check ``root``'s parents, ``root`` and the folder ``root/name`` with everything below it,
    through one open handle of each; yield a path to exactly that opened folder for the load.

    A symbolic link inside the tree is refused (the load would leave the checked handle).
    """
    root = Path(os.path.realpath(root))
    check_parents(root)
    try:
        root_fd = os.open(root, _DIR_FLAGS)
    except OSError as exc:
        raise CheckpointError(f"cannot open the checkpoint folder {root}: {exc}") from exc
    try:
        check_trusted(root, os.fstat(root_fd))
        try:
            top_fd = os.open(name, _DIR_FLAGS, dir_fd=root_fd)
        except OSError as exc:
            raise CheckpointError(f"cannot open the checkpoint {root / name}: {exc}") from exc
    finally:
        os.close(root_fd)
    try:
        _check_opened(root / name, top_fd)
        handle = Path(f"/proc/self/fd/{top_fd}")
        yield handle if handle.is_dir() else root / name  # no /proc: the path, checked just now
    finally:
        os.close(top_fd)


def _check_opened(top: Path, top_fd: int) -> None:
    check_trusted(top, os.fstat(top_fd))
    for dirpath, dirnames, filenames, dir_fd in os.fwalk(".", dir_fd=top_fd, follow_symlinks=False):
        here = top / os.path.normpath(dirpath)
        for entry in (*dirnames, *filenames):
            st = os.stat(entry, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise CheckpointError(
                    f"refusing to load from {here / entry}: it is a symbolic link, and a checkpoint "
                    "holds none; loading a checkpoint unpickles its metadata",
                    hint="copy the file it points to into the checkpoint, reviewed",
                )
            check_trusted(here / entry, st)


def make_private(top: Path) -> None:
    """Remove group and other write permission from ``top`` and everything below it (a fresh save)."""
    paths = [top]
    for dirpath, dirnames, filenames in os.walk(top):
        paths += [Path(dirpath) / name for name in (*dirnames, *filenames)]
    for path in paths:
        mode = os.lstat(path).st_mode
        if not stat.S_ISLNK(mode) and mode & WRITABLE_BY_OTHERS:
            os.chmod(path, stat.S_IMODE(mode) & ~WRITABLE_BY_OTHERS)
