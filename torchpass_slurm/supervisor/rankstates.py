"""The copies of each logical rank's own state (its data loader position), for the spare that takes it.

No replica holds what belongs to one rank, so every rank sends the supervisor a copy each
step (``rank_state``, ``control/rankstate.py``), tagged with the committed step it is valid
at: the rank captures it when the step's collectives start, so the copy of step k+1 is here
before step k can commit anywhere. :class:`RankStates` keeps the last
:data:`~torchpass_slurm.control.rankstate.MAX_RANK_STATE_COPIES` per rank::

    copies of rank 1    tags 7, 8        step 8 is being computed (8 = valid once step 7 commits)
    rank 1 dies; the survivors agree on 7 or 8: either copy is here
    spare promoted      promote.rank_state = [[7, {...}], [8, {...}]]: it loads the one tagged
                        with the agreed step, or stops and says so (rank_state_missing)

A copy whose tag is not above the ones kept (a discarded step, a restart from a
checkpoint) replaces them: the kept copies are always of the rank's latest history.
Pure apart from the log line of a refused copy; nothing received is unpickled.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from torchpass_slurm.control.rank_bodies import RankStateCopy
from torchpass_slurm.control.rankstate import MAX_RANK_STATE_COPIES
from torchpass_slurm.supervisor.membership import Membership

__all__ = ["RankStates", "Copy"]

logger = logging.getLogger(__name__)

#: One copy: (step tag, state).
Copy = tuple[int, Mapping[str, Any]]


class RankStates:
    """The last copies of each logical rank's own state; see the module docstring."""

    def __init__(self) -> None:
        self._copies: dict[int, list[Copy]] = {}
        #: drained nodes handing over: the ranks they held (they send copies up to the switch)
        self._leaving: dict[str, range] = {}

    def leaving(self, node: str, ranks: range) -> None:
        """``node`` is drained and holds ``ranks`` until it switches: its copies still count."""
        self._leaving[node] = ranks

    def offer(self, rank: int, tag: int, state: Mapping[str, Any]) -> None:
        """Keep a copy: copies tagged ``tag`` or later are dropped first, then the oldest beyond the limit."""
        kept = [c for c in self._copies.get(rank, []) if c[0] < tag]
        self._copies[rank] = [*kept, (tag, state)][-MAX_RANK_STATE_COPIES:]

    def copies(self, rank: int) -> tuple[Copy, ...]:
        """The copies of ``rank``, oldest first (none: the job keeps no rank state)."""
        return tuple(self._copies.get(rank, ()))

    def holds(self, ranks: range | list[int]) -> bool:
        """Whether any of ``ranks`` has a copy (the job keeps rank state)."""
        return any(r in self._copies for r in ranks)

    def accept(self, membership: Membership, node: str, sender: str, copy: RankStateCopy) -> bool:
        """Keep the copy of a ``rank_state`` message if its rank is the sender's: task ``node/L``
        holds rank ``rank_base(node) + L`` and no other."""
        rank, local = copy.rank, sender.rsplit("/", 1)[-1]
        held = membership.ranks_of(node) if node in membership.active else self._leaving.get(node)
        if held is None or not local.isdigit() or rank != held.start + int(local) or rank not in held:
            logger.warning("refused the rank state of rank %s from %s: not that task's rank", rank, sender)
            return False
        self.offer(rank, copy.step, copy.state)
        return True
