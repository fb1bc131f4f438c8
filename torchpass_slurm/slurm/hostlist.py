"""Slurm hostlists: ``n[1-3,7],gpu01`` <-> ``("n1", "n2", "n3", "n7", "gpu01")``.

Pure functions over the maintained ``python-hostlist`` library (import name
``hostlist``); its errors become :class:`~torchpass_slurm.errors.HostlistError`
with the offending input quoted. Order is kept as written: Slurm lists a job's
nodes in its own order, and callers compare lists, not sets.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import hostlist as _pyhostlist

from torchpass_slurm.errors import HostlistError

__all__ = ["expand", "compress"]

# A single node name: no separators, brackets or whitespace.
_NAME = re.compile(r"^[^\s,\[\]]+$")


def expand(expr: str) -> tuple[str, ...]:
    """Expand a hostlist expression into node names, in order, without duplicates.

    ``expand("n[1-2],x")`` is ``("n1", "n2", "x")``; ``expand("")`` is ``()``.
    """
    text = expr.strip()
    if not text:
        return ()
    if any(ch.isspace() for ch in text):
        raise HostlistError(
            f"malformed hostlist {expr!r}: it contains whitespace",
            hint="separate names with commas, e.g. 'n[1-3],gpu01'.",
        )
    try:
        names = _pyhostlist.expand_hostlist(text)
    except _pyhostlist.BadHostlist as err:
        raise HostlistError(
            f"malformed hostlist {expr!r}: {err}",
            hint="write ranges as prefix[a-b,c], e.g. 'n[1-3,7]'.",
        ) from None
    return tuple(names)


def compress(names: Iterable[str]) -> str:
    """Compress node names into the shortest Slurm hostlist, e.g. ``n[1-3]``.

    Duplicates are dropped. Each name must be a single node name (no commas,
    brackets or whitespace): compress what :func:`expand` returned.
    """
    items = list(names)
    for name in items:
        if not _NAME.match(name):
            raise HostlistError(
                f"not a node name: {name!r}",
                hint="give plain node names such as 'n1'; expand hostlists first.",
            )
    return str(_pyhostlist.collect_hostlist(items))
