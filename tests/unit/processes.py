"""Whether a process still runs, for tests that check what was killed."""

from __future__ import annotations

import time


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, dead but not reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def gone_within(pid: int, seconds: float) -> bool:
    """Wait up to ``seconds`` for ``pid`` to end; True when it did."""
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)
