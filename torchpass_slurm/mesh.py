"""Where each rank sits in a device mesh, and who else holds the same shard. Pure.

A sharded job lays its ranks out on a mesh the way ``torch.distributed.init_device_mesh``
does: row-major, rank ``r`` at ``numpy.unravel_index(r, shape)``. HSDP on 4 ranks, 2
replica groups of 2 shards each::

                 shard 0   shard 1
    replicate 0  rank 0    rank 1        rank 2 holds the same shard as rank 0:
    replicate 1  rank 2    rank 3        it is rank 0's replica, and its donor

A rank's *replicas* are the ranks whose coordinates are equal in every dimension but the
replicate dimension. DDP is the mesh ``("replicate",)`` of the world: every rank is a
replica of every other. Pure FSDP, ``("shard",)``, has no replicate dimension: a rank
lost without warning has no replica, and only a planned move (the leaving rank sends its
own shards) keeps its state.

A :class:`MeshLayout` is also what the ranks tell the supervisor (:meth:`to_json`), so that
the recovery planner knows whether a lost rank's state still exists somewhere.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["MeshLayout", "REPLICATE", "MAX_MESH_DIMS", "assign_donors"]

#: The name of the replicate dimension (TorchTitan's and torch's HSDP examples use it).
REPLICATE = "replicate"
#: Most dimensions a layout may have (TorchTitan uses at most five: pp, dp_replicate, dp_shard, cp, tp).
MAX_MESH_DIMS = 8
#: Longest dimension name accepted from a rank's report.
MAX_DIM_NAME = 32


@dataclass(frozen=True)
class MeshLayout:
    """A mesh of ``math.prod(shape)`` ranks with named dimensions; ``replicate`` names the
    dimension whose ranks hold the same state (``None``: no rank has a replica)."""

    dims: tuple[str, ...]
    shape: tuple[int, ...]
    replicate: str | None = REPLICATE

    def __post_init__(self) -> None:
        if not self.dims or len(self.dims) != len(self.shape):
            raise ValueError(
                f"a mesh needs one size per dimension; got dims {self.dims} and shape {self.shape}"
            )
        if len(self.dims) > MAX_MESH_DIMS:
            raise ValueError(f"a mesh has at most {MAX_MESH_DIMS} dimensions; got {len(self.dims)}")
        for name in self.dims:
            if not isinstance(name, str) or not name or len(name) > MAX_DIM_NAME or not name.isidentifier():
                raise ValueError(
                    f"a mesh dimension name is an identifier of 1-{MAX_DIM_NAME} characters; got {name!r}"
                )
        if len(set(self.dims)) != len(self.dims):  # after the type check: set() needs hashable names
            raise ValueError(f"mesh dimension names must differ; got {self.dims}")
        for size in self.shape:
            if type(size) is not int or size < 1:
                raise ValueError(f"mesh sizes are positive integers; got {self.shape}")
        if self.replicate is not None and self.replicate not in self.dims:
            raise ValueError(f"the replicate dimension {self.replicate!r} is not one of {self.dims}")

    # -- construction --------------------------------------------------------
    @classmethod
    def ddp(cls, world_size: int) -> MeshLayout:
        """Plain data parallelism: every rank a replica of every other."""
        return cls((REPLICATE,), (world_size,))

    @classmethod
    def from_json(cls, value: Any) -> MeshLayout:
        """The layout a rank reported; ValueError when it is not one."""
        if not isinstance(value, Mapping):
            raise ValueError("a mesh layout is an object with dims, shape and replicate")
        unknown = set(value) - {"dims", "shape", "replicate"}
        if unknown:
            raise ValueError(f"unknown mesh layout keys {sorted(unknown)}; valid: dims, shape, replicate")
        dims, shape = value.get("dims"), value.get("shape")
        if not isinstance(dims, list) or not isinstance(shape, list) or len(dims) > MAX_MESH_DIMS:
            raise ValueError(f"a mesh layout's dims and shape are lists of at most {MAX_MESH_DIMS} items")
        replicate = value.get("replicate")
        if replicate is not None and not isinstance(replicate, str):
            raise ValueError("a mesh layout's replicate is a dimension name or null")
        return cls(tuple(dims), tuple(shape), replicate)

    def to_json(self) -> dict[str, Any]:
        return {"dims": list(self.dims), "shape": list(self.shape), "replicate": self.replicate}

    # -- geometry ------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def coord(self, rank: int) -> tuple[int, ...]:
        """The rank's coordinate, row-major as ``init_device_mesh`` lays ranks out."""
        self._check_rank(rank)
        out = []
        for size in reversed(self.shape):
            rank, index = divmod(rank, size)
            out.append(index)
        return tuple(reversed(out))

    def rank_at(self, coord: Sequence[int]) -> int:
        if len(coord) != len(self.shape) or any(
            not 0 <= c < s for c, s in zip(coord, self.shape, strict=True)
        ):
            raise ValueError(f"coordinate {tuple(coord)} is outside the mesh {self.shape}")
        rank = 0
        for c, size in zip(coord, self.shape, strict=True):
            rank = rank * size + c
        return rank

    def shard_coord(self, rank: int) -> tuple[int, ...]:
        """The coordinate without the replicate dimension: equal for ranks holding the same state."""
        coord = self.coord(rank)
        if self.replicate is None:
            return coord
        skip = self.dims.index(self.replicate)
        return coord[:skip] + coord[skip + 1 :]

    def replica_index(self, rank: int) -> int:
        """The rank's place along the replicate dimension (0 without one)."""
        if self.replicate is None:
            return 0
        return self.coord(rank)[self.dims.index(self.replicate)]

    def replicas(self, rank: int) -> list[int]:
        """The other ranks that hold the same state as ``rank``, in rank order."""
        if self.replicate is None:
            self._check_rank(rank)
            return []
        axis = self.dims.index(self.replicate)
        coord = list(self.coord(rank))
        mine = coord[axis]
        out = []
        for i in range(self.shape[axis]):
            if i != mine:
                coord[axis] = i
                out.append(self.rank_at(coord))
        return out

    def without_replica(self, lost: Iterable[int]) -> list[int]:
        """The lost ranks none of whose replicas survive: their state exists nowhere else."""
        gone = set(lost)
        return sorted(r for r in gone if all(peer in gone for peer in self.replicas(r)))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.world_size} ranks")


def assign_donors(
    layout: MeshLayout, receivers: Collection[int], holders: Collection[int], avoid: Collection[int] = ()
) -> dict[int, int]:
    """For each receiver, the holder that sends it its state: a replica of the receiver,
    spread over the replica groups (the least used group first, then the lowest rank), and
    ranks in ``avoid`` (the batch host's, say) only when nothing else holds that state.

    A receiver with no holding replica is left out of the answer: the caller decides what a
    state that exists nowhere means (a checkpoint restart, with the reason ``no replica``).
    """
    holding = set(holders) - set(receivers)
    used: dict[int, int] = {}
    plan: dict[int, int] = {}
    for recv in sorted(receivers):
        candidates = [r for r in layout.replicas(recv) if r in holding]
        if not candidates:
            continue
        donor = min(candidates, key=lambda r: (r in avoid, used.get(layout.replica_index(r), 0), r))
        used[layout.replica_index(donor)] = used.get(layout.replica_index(donor), 0) + 1
        plan[recv] = donor
    return plan
