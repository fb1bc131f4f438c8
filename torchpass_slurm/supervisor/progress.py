"""The job's pace, from the steps its heartbeats carry: how long one step takes.

The supervisor needs it to announce a planned switch far enough ahead: the
ranks switch epochs after an agreed step S, which every rank must hear of
before it commits S. The hang detector needs it too: a job whose step has not
moved for a few steps' time is stuck. Heartbeats carry each rank's step; the highest one moves
as the training does. One step's time is the median of the recent intervals
between two advances of that highest step, so that a pause (a recovery, a
checkpoint) weighs as one sample, not as the average.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

__all__ = ["Progress"]

#: Intervals kept for the median.
WINDOW = 32


class Progress:
    """Observes the highest committed step over time; see the module docstring."""

    def __init__(self, window: int = WINDOW) -> None:
        self._last: tuple[float, int] | None = None
        self._intervals: deque[float] = deque(maxlen=window)

    def observe(self, now: float, step: int | None) -> None:
        """The highest step reported at ``now`` (seconds, any clock that only moves forward)."""
        if step is None:
            return
        if self._last is None or step < self._last[1]:  # the first, or a resume from a checkpoint
            self._last = (now, step)
        elif step > self._last[1]:
            t0, s0 = self._last
            per_step = (now - t0) / (step - s0)
            self._intervals.extend([per_step] * min(step - s0, self._intervals.maxlen or 1))
            self._last = (now, step)

    @property
    def last_advance(self) -> float | None:
        """When the highest step last moved (the clock of :meth:`observe`), or None."""
        return self._last[0] if self._last is not None else None

    @property
    def step_seconds(self) -> float | None:
        """The median time of one step, once two advances were seen."""
        return statistics.median(self._intervals) if self._intervals else None

    def steps_ahead(self, lead_s: float, *, minimum: int = 2) -> int:
        """How many steps the training makes in ``lead_s`` seconds, plus one (at least
        ``minimum``); with no pace known yet, one step a second is assumed."""
        step_s = self.step_seconds
        if step_s is None or step_s <= 0:
            return max(minimum, math.ceil(lead_s))
        return max(minimum, math.ceil(lead_s / step_s) + 1)
