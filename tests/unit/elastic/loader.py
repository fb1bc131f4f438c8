"""A small deterministic stateful data loader (no torchpass in it), for the tests of ``rank_state``.

Rank ``r`` of ``world`` reads its shard of ``0..size-1`` in an order shuffled per epoch by
``(seed, epoch)``, ``batch`` items at a time; ``state_dict`` is its position, as JSON. Where
torchdata is installed, ``torchdata.stateful_dataloader.StatefulDataLoader`` plays the same
part (its ``state_dict`` is JSON for a map-style dataset with the default sampler).
"""

from __future__ import annotations

import random
from typing import Any


class ShardLoader:
    """Batches of this rank's shard; ``next_batch()`` draws one; the position is the state."""

    def __init__(self, rank: int, world: int, *, size: int = 64, batch: int = 2, seed: int = 0) -> None:
        self.shard = list(range(rank, size, world))
        self.batch, self.seed = batch, seed
        self.epoch, self.position = 0, 0

    def _order(self) -> list[int]:
        order = list(self.shard)
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next_batch(self) -> list[int]:
        if self.position + self.batch > len(self.shard):
            self.epoch, self.position = self.epoch + 1, 0
        out = self._order()[self.position : self.position + self.batch]
        self.position += self.batch
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position, self.seed = state["epoch"], state["position"], state["seed"]
