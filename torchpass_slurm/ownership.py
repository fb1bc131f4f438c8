"""Who besides a path's owner can change it: the rule the checkpoints and the run folder share.

A path is this user's to trust when it belongs to this user or to root and nobody else may
write it (:func:`foreign`). A folder *above* the user's own may be shared the ways every home
is: a sticky folder (``/tmp``: others cannot rename what is not theirs), or a folder writable
by a group that is the user's own primary group (``above=True``).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

__all__ = ["WRITABLE_BY_OTHERS", "Foreign", "foreign", "owner_name"]

#: The mode bits that let someone other than the owner write a path.
WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


@dataclass(frozen=True)
class Foreign:
    """Why a path is not this user's alone: a foreign ``owner`` (a uid), or who else may write
    it (``writers``: ``"its group"``, ``"others"`` or ``"its group and others"``)."""

    owner: int | None = None
    writers: str | None = None


def foreign(st: os.stat_result, *, above: bool = False) -> Foreign | None:
    """Why someone other than this user or root controls the path ``st`` describes; None when
    nobody does. ``above``: the path is a folder above the user's own (see the module doc)."""
    if st.st_uid not in (os.geteuid(), 0):
        return Foreign(owner=st.st_uid)
    bits = st.st_mode & WRITABLE_BY_OTHERS
    if above and st.st_mode & stat.S_ISVTX:
        bits = 0
    if above and st.st_gid == os.getegid():
        bits &= ~stat.S_IWGRP
    if not bits:
        return None
    who = {stat.S_IWGRP: "its group", stat.S_IWOTH: "others"}.get(bits, "its group and others")
    return Foreign(writers=who)


def owner_name(uid: int) -> str:
    """``uid N (name)``, or ``uid N`` where the user database does not know it."""
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"
