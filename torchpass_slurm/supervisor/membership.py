"""Membership: which node holds which logical ranks, the spare pool, the epoch.

Pure: no I/O, no clock, no Slurm. The supervisor holds one :class:`Membership`
and replaces it with a new one on every change; each change bumps the epoch,
which fences ranks of an older epoch out of the data plane.

Logical slots. ``active[i]`` holds global ranks ``i*k .. i*k+k-1`` (``k`` =
``ntasks_per_node``). A promoted spare takes the failed node's *slot*, so the
world size and the rank order never change and every rank keeps its data
shard::

    epoch 0   active = (n1, n2, n3)          spares = (s1, s2)   failed = ()
              slot:       0   1   2
              ranks:    0-3 4-7 8-11         (k = 4)

    n2 dies:  replace("n2")

    epoch 1   active = (n1, s1, n3)          spares = (s2,)      failed = (n2,)
              slot:       0   1   2
              ranks:    0-3 4-7 8-11         s1 now runs ranks 4-7, as n2 did

    s2 dies on standby: drop_spare("s2")

    epoch 2   active = (n1, s1, n3)          spares = ()         failed = (n2, s2)

    n3 dies:  replace("n3")  ->  NoSpareError (fall back to checkpoint-restart)
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torchpass_slurm.config import NodeRole
from torchpass_slurm.errors import ConfigError, MembershipError, NoSpareError

__all__ = [
    "Membership",
]


#: Version of the JSON form written by :meth:`Membership.to_json`.
_JSON_FORMAT = 1


@dataclass(frozen=True)
class Membership:
    """The supervisor's model of the job: logical slots, spares, failures, epoch."""

    epoch: int
    ntasks_per_node: int
    active: tuple[str, ...]
    spares: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("active", "spares", "failed"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        _check_int("epoch", self.epoch, minimum=0)
        _check_int("ntasks_per_node", self.ntasks_per_node, minimum=1)
        if not self.active:
            raise MembershipError("a membership needs at least one active node")
        everyone = self.active + self.spares + self.failed
        bad = [n for n in everyone if not isinstance(n, str) or not n]
        if bad:
            raise MembershipError(f"node names must be non-empty strings; got {bad!r}")
        dupes = sorted(n for n, times in Counter(everyone).items() if times > 1)  # one pass, not n^2
        if dupes:
            raise MembershipError(f"node(s) listed more than once: {', '.join(dupes)}")

    @classmethod
    def initial(cls, nodes: Sequence[str], n_active: int, ntasks_per_node: int) -> Membership:
        """Epoch 0: the first ``n_active`` nodes are active, the rest are spares."""
        nodes = tuple(nodes)
        if n_active < 1 or ntasks_per_node < 1:
            raise ConfigError(
                f"need at least 1 active node and 1 task per node; got {n_active} active, "
                f"{ntasks_per_node} per node"
            )
        if len(nodes) < n_active:
            raise ConfigError(
                f"the allocation has {len(nodes)} node(s) but {n_active} active node(s) were requested",
                hint="ask Slurm for N + S nodes (tp-submit does this with --spares S)",
            )
        try:
            return cls(0, ntasks_per_node, nodes[:n_active], nodes[n_active:])
        except MembershipError as exc:
            raise ConfigError(f"bad node list: {exc.message}") from None

    # --- queries ---------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Number of ranks in the data plane (never changes across epochs)."""
        return len(self.active) * self.ntasks_per_node

    def role_of(self, node: str) -> NodeRole:
        """Active, spare or failed."""
        if node in self.active:
            return NodeRole.ACTIVE
        if node in self.spares:
            return NodeRole.SPARE
        if node in self.failed:
            return NodeRole.FAILED
        raise MembershipError(f"node {node!r} is not part of this job (epoch {self.epoch})")

    def slot_of(self, node: str) -> int:
        """The logical slot (index into :attr:`active`) of an active node."""
        if node not in self.active:
            raise MembershipError(
                f"node {node!r} holds no ranks: {self._describe(node)} in epoch {self.epoch}"
            )
        return self.active.index(node)

    def rank_base(self, node: str) -> int:
        """First global rank of an active node."""
        return self.slot_of(node) * self.ntasks_per_node

    def ranks_of(self, node: str) -> range:
        """Global ranks of an active node."""
        base = self.rank_base(node)
        return range(base, base + self.ntasks_per_node)

    def node_of_rank(self, rank: int) -> str:
        """The active node that runs global rank ``rank``."""
        if not 0 <= rank < self.world_size:
            raise MembershipError(f"rank {rank} is outside 0..{self.world_size - 1}")
        return self.active[rank // self.ntasks_per_node]

    # --- changes ---------------------------------------------------------------

    def replace(self, failed_node: str) -> Membership:
        """Promote the first spare into ``failed_node``'s slot; the next epoch.

        Raises NoSpareError when the pool is empty, MembershipError when the
        node is not active.
        """
        return self.replace_all([failed_node])

    def replace_all(self, failed_nodes: Sequence[str], *, epoch: int | None = None) -> Membership:
        """Promote spares, in pool order, into the failed nodes' slots (in the given order).

        One membership change: the epoch becomes ``epoch`` (default: the next
        one). Raises NoSpareError when the pool runs out, MembershipError when
        a node is not active.
        """
        active, spares, failed = list(self.active), list(self.spares), list(self.failed)
        for node in failed_nodes:
            slot = self.slot_of(node)
            if not spares:
                ranks = self.ranks_of(node)
                raise NoSpareError(
                    f"active node {node!r} (ranks {ranks.start}-{ranks.stop - 1}) failed and no "
                    "spare is left",
                    hint="the job must fall back to checkpoint-restart; ask for more spares "
                    "(tp-submit --spares) next time",
                )
            active[slot] = spares.pop(0)
            failed.append(node)
        return Membership(
            self.epoch + 1 if epoch is None else epoch,
            self.ntasks_per_node,
            tuple(active),
            tuple(spares),
            tuple(failed),
        )

    def with_spare(self, node: str) -> Membership:
        """``node`` joins the spare pool (a refill), in the same epoch: no rank moves. A node
        the job lost before and that Slurm gave back (repaired) leaves ``failed``."""
        if node in self.active or node in self.spares:
            raise MembershipError(f"{node} cannot join as a spare: it is {self._describe(node)}")
        failed = tuple(n for n in self.failed if n != node)
        return Membership(self.epoch, self.ntasks_per_node, self.active, (*self.spares, node), failed)

    def drop_spare(self, node: str) -> Membership:
        """A spare died on standby: remove it from the pool; the next epoch."""
        return self.without_spares([node])

    def without_spares(self, nodes: Sequence[str]) -> Membership:
        """Spares that died or were drained leave the pool (one change: the next epoch)."""
        for node in nodes:
            if node not in self.spares:
                raise MembershipError(
                    f"node {node!r} is not a spare: {self._describe(node)} in epoch {self.epoch}"
                )
        spares = tuple(s for s in self.spares if s not in nodes)
        return Membership(
            self.epoch + 1, self.ntasks_per_node, self.active, spares, self.failed + tuple(nodes)
        )

    def next_epoch(self, after: int | None = None) -> Membership:
        """The same members in the epoch after ``after`` (default: this one)."""
        return Membership(
            (self.epoch if after is None else after) + 1,
            self.ntasks_per_node,
            self.active,
            self.spares,
            self.failed,
        )

    # --- JSON --------------------------------------------------------------------

    def to_json(self) -> str:
        """A one-line JSON form (for status files and events)."""
        return json.dumps(
            {
                "format": _JSON_FORMAT,
                "epoch": self.epoch,
                "ntasks_per_node": self.ntasks_per_node,
                "active": list(self.active),
                "spares": list(self.spares),
                "failed": list(self.failed),
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> Membership:
        """Parse :meth:`to_json` output; MembershipError says what is wrong."""
        try:
            obj: Any = json.loads(text)
        except ValueError as exc:
            raise MembershipError(f"membership is not JSON: {exc}") from None
        expected = {"format", "epoch", "ntasks_per_node", "active", "spares", "failed"}
        if not isinstance(obj, dict) or set(obj) != expected:
            seen = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise MembershipError(
                f"membership JSON has fields {seen}; expected {', '.join(sorted(expected))}"
            )
        if obj["format"] != _JSON_FORMAT:
            raise MembershipError(
                f"membership JSON has format {obj['format']!r}; this version reads {_JSON_FORMAT}"
            )
        for name in ("active", "spares", "failed"):
            if not isinstance(obj[name], list):
                raise MembershipError(f"membership JSON field {name!r} is not a list")
        return cls(obj["epoch"], obj["ntasks_per_node"], obj["active"], obj["spares"], obj["failed"])

    def _describe(self, node: str) -> str:
        try:
            return f"its role is {self.role_of(node).value!r}"
        except MembershipError:
            return "it is not part of this job"


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise MembershipError(f"{name} must be an integer >= {minimum}; got {value!r}")
