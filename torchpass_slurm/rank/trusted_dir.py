"""Only load a checkpoint that nobody but its owner could have written.

torch.distributed.checkpoint unpickles the ``.metadata`` file of a checkpoint
(and pickled items in its data files) on every rank that loads it: whoever
can write into the checkpoint folder can make every rank run code of their
choice. So before loading, every path that the load reads must be

- owned by the user running the training (or by root), and
- not writable by group or others.

The same holds for the checkpoint folder itself: someone who may create
entries in it can put a ``step-<N>`` folder of their own there (which the
owner check then refuses) or rename ours away. Symbolic links are followed,
so a link to someone else's file is refused by its target's owner.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

from torchpass_slurm.errors import CheckpointError
from torchpass_slurm.ownership import WRITABLE_BY_OTHERS, foreign, owner_name

__all__ = ["check_trusted", "check_trusted_tree", "make_private"]


def check_trusted(path: Path) -> None:
    """Raise CheckpointError unless ``path`` is owned by this user (or root) and not group/other writable."""
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


def check_trusted_tree(root: Path, inside: Iterable[Path] = ()) -> None:
    """:func:`check_trusted` on ``root`` and on ``inside`` and everything below them."""
    check_trusted(root)
    for top in inside:
        check_trusted(top)
        if top.is_dir():
            for dirpath, dirnames, filenames in os.walk(top):
                for name in (*dirnames, *filenames):
                    check_trusted(Path(dirpath) / name)


def make_private(top: Path) -> None:
    """Remove group and other write permission from ``top`` and everything below it (a fresh save)."""
    paths = [top]
    for dirpath, dirnames, filenames in os.walk(top):
        paths += [Path(dirpath) / name for name in (*dirnames, *filenames)]
    for path in paths:
        mode = os.lstat(path).st_mode
        if not stat.S_ISLNK(mode) and mode & WRITABLE_BY_OTHERS:
            os.chmod(path, stat.S_IMODE(mode) & ~WRITABLE_BY_OTHERS)
