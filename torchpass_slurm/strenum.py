"""The base of every vocabulary that crosses a process boundary or lands in a file.

A :class:`StrEnum` member is its string: it compares equal to it, hashes like
it, is written by ``json`` as it, and prints (``str``, f-strings) as it, so
the wire, the event log and the log lines all carry the plain value.
(``enum.StrEnum`` of Python 3.11, for the 3.10 this package supports.)
"""

from __future__ import annotations

import enum

__all__ = ["StrEnum"]


class StrEnum(str, enum.Enum):
    """An enum whose members are strings and print as their value."""

    def __str__(self) -> str:
        return str(self.value)
