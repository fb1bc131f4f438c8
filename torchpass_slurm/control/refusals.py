"""Counting and logging what the control plane refused, rate-limited per cause (no zmq).

A flood of one kind of junk must neither fill the log nor hide a different
problem that comes later: each cause has its own budget. A cause is a short
label (``"unknown client key"``) or, for a message the decoder refused, the
error's text with its particulars (numbers, quoted values) taken out, so that
"seq 17 is not above 18" and "seq 3 is not above 9" are one cause.
"""

from __future__ import annotations

import logging
import re
import threading

__all__ = ["RefusalLog", "cause_of"]

_PARTICULARS = re.compile(r"b?'[^']*'|b?\"[^\"]*\"|[-+]?\d[\d.e+-]*|\bpeer [0-9a-f]+")


def cause_of(text: str) -> str:
    """The cause of a refusal whose message is ``text``: the text without its particulars."""
    return _PARTICULARS.sub("…", text)[:120]


class RefusalLog:
    """Per-cause counts of refusals, logged at WARNING: the first :attr:`LOG_FIRST` of each
    cause, then every :attr:`LOG_EVERY`-th. At most :attr:`MAX_CAUSES` causes are told apart
    (a hostile peer cannot grow the table); the rest count as ``"other"``. Thread-safe."""

    LOG_FIRST = 20
    LOG_EVERY = 1000
    MAX_CAUSES = 64

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self._logger = logger
        self._what = what
        self._lock = threading.Lock()
        #: refusals so far, by cause
        self.counts: dict[str, int] = {}
        #: refusals so far, all causes
        self.total = 0

    def refuse(self, cause: str, origin: str, detail: str) -> None:
        """Count one refusal of ``cause`` from ``origin`` and log it unless its cause is flooding."""
        with self._lock:
            if cause not in self.counts and len(self.counts) >= self.MAX_CAUSES:
                cause = "other"
            n = self.counts.get(cause, 0) + 1
            self.counts[cause] = n
            self.total += 1
        if n <= self.LOG_FIRST or n % self.LOG_EVERY == 0:
            more = (
                f" (cause seen {n} times; logged: the first {self.LOG_FIRST}, then every {self.LOG_EVERY}th)"
                if n == self.LOG_FIRST
                else ""
            )
            self._logger.warning("%s #%d from %s: %s%s", self._what, n, origin, detail, more)
