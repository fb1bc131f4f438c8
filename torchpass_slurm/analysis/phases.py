"""The recovery-time split of one fault (``tp report``'s phases; the rules are in
:mod:`torchpass_slurm.analysis.report`)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torchpass_slurm.rundir.events import Event

__all__ = ["PHASES", "Phases", "last_heartbeat", "round_ms", "split_phases"]

#: Phase names, in order; ``total`` is kept apart.
PHASES = ("detection", "decision", "rebuild", "agreement", "transfer", "first_step")


@dataclass(frozen=True)
class Phases:
    """The recovery-time split of one fault, in seconds; None where the log lacks an end."""

    detection: float | None = None
    decision: float | None = None
    rebuild: float | None = None
    agreement: float | None = None
    transfer: float | None = None
    first_step: float | None = None
    total: float | None = None

    def as_dict(self) -> dict[str, float | None]:
        """Every phase and ``total``, rounded to milliseconds."""
        names = (*PHASES, "total")
        return {name: round_ms(getattr(self, name)) for name in names}


def split_phases(heartbeat: float | None, detected: Event | None, ends: Sequence[Event | None]) -> Phases:
    """Consecutive intervals ``heartbeat`` -> ``detected`` -> each of ``ends`` (migration_started,
    group_rebuilt, agreement, transfer_done, first_step); total = the last end - detected."""
    marks = [heartbeat, _ts(detected), *(_ts(e) for e in ends)]
    # The ranks' reports reach the supervisor in any order: a rank's group_rebuilt can
    # be logged after the agreement, which needs every rank's group. Each phase ended
    # by the time the next one did, so an earlier mark is capped by the later ones.
    for i in range(len(marks) - 2, 1, -1):
        later = next((m for m in marks[i + 1 :] if m is not None), None)
        mark = marks[i]
        if mark is not None and later is not None and mark > later:
            marks[i] = later
    spans = [_interval(a, b) for a, b in itertools.pairwise(marks)]
    return Phases(**dict(zip(PHASES, spans, strict=True)), total=_interval(marks[1], marks[-1]))


def last_heartbeat(started: Event | None, node: str) -> float | None:
    """The failed node's last heartbeat, from ``migration_started`` (a number or ``{node: ts}``)."""
    if started is None:
        return None
    value = started.fields.get("last_heartbeat")
    if isinstance(value, Mapping):
        value = value.get(node)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _ts(event: Event | None) -> float | None:
    return None if event is None else event.ts


def _interval(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None or end < start else end - start


def round_ms(value: float | None) -> float | None:
    """Seconds rounded to milliseconds (None stays None)."""
    return None if value is None else round(value, 3)
