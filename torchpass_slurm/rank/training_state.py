"""What the trainer and the handover need of a rank's training state: the injected adapter.

One trainer (:class:`~torchpass_slurm.rank.elastic.ElasticTrainer`) and one handover
(:class:`~torchpass_slurm.rank.handover.Handover`) serve every layout; what differs is how
a rank's state is built, read, judged and loaded, and that is a :class:`TrainingState`:

===================  =======================================  ========================================
                     :class:`~.replicated.ReplicatedState`    :class:`~.sharded.ShardedState`
                     (DDP)                                    (FSDP2, HSDP)
===================  =======================================  ========================================
layout               ``MeshLayout.ddp(world)``: all replicas  the user's mesh; maybe no replicate dim
the model            given once, lives across epochs          ``build(mesh)`` on every epoch's mesh
a new epoch          nothing to do                            rebuild; keep the rank's own shards
what a donor sends   every Stateful's full ``state_dict``     its own local shards, with their specs
the receiver judges  nothing beyond the stream's checks       mesh, coordinate, every tensor's spec
a drained rank       leaves (a replica serves the spare)      serves its shards to the spare, leaves
the wrap             a fresh DDP per epoch                    FSDP2, wrapped in ``build``
checkpoints          ``checkpoint`` (DCP)                     ``shard_checkpoint`` (a file per rank)
===================  =======================================  ========================================
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from torchpass_slurm.mesh import MeshLayout
    from torchpass_slurm.rank.rankstate import RankState
    from torchpass_slurm.transfer import Manifest

__all__ = ["TrainingState", "Accept"]

#: Judges a donor's manifest before anything is written (raises TransferError to refuse it).
Accept = Callable[["Manifest"], None]


class TrainingState(Protocol):
    """A rank's training state, as the trainer and the handover use it (module doc)."""

    #: ranks chosen as a donor only when no other rank holds the state
    avoid: Collection[int]
    #: a rank leaving by a drain sends its own state to the spare taking its rank (no replica
    #: may hold it); False: it just leaves, and a replica serves the spare
    leaving_donor: bool
    #: a receive cut short by a donor's death resumes in the next epoch (the tensors it fills
    #: outlive the epoch)
    resumable: bool

    @property
    def model(self) -> nn.Module: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    @property
    def state(self) -> dict[str, Any]:
        """Name -> Stateful: what a (DCP) checkpoint of the rank holds besides its rank state."""
        ...

    def layout(self, world_size: int) -> MeshLayout:
        """Where each rank of a group of ``world_size`` sits, and who holds whose state."""
        ...

    def ready(self) -> dict[str, Any]:
        """Build what needs the group, before ``live_ready``; what that report says besides the step."""
        ...

    def renew(self) -> None:
        """The epoch's new group is up: make the state live on it (before the handover)."""
        ...

    def wrap(self, on_forward: Callable[..., None]) -> nn.Module | None:
        """Wrap the model for this epoch's group and hook ``on_forward`` before its collectives;
        the module ``train_step`` is given, or None for the model itself."""
        ...

    def outgoing(self, rank: int, step: int) -> tuple[Mapping[str, Any], Any]:
        """What donor ``rank`` sends of the state of ``step``: the state and the manifest's meta."""
        ...

    def incoming(self, rank: int, donor: int, step: int) -> tuple[Mapping[str, Any], Accept | None]:
        """Where rank ``rank`` receives ``donor``'s state of ``step`` in place, and its judge."""
        ...

    def load(self, received: Mapping[str, Any]) -> None:
        """Load a received state (judged already)."""
        ...

    def agreement_fields(
        self, holders: list[int], plan: Mapping[int, int], leaving: Collection[int]
    ) -> dict[str, Any]:
        """What rank 0's ``agreement`` report says besides the step, the receivers and the epoch."""
        ...

    def transfer_fields(self, via: str) -> dict[str, Any]:
        """What a ``transfer_done`` report says besides the stream's stats (``via``: group or socket)."""
        ...

    def load_checkpoint(self, directory: Any, rank_state: RankState | None) -> int | None:
        """Load the newest checkpoint under ``directory`` (and this rank's own state); its step."""
        ...

    def save_checkpoint(self, directory: Any, step: int, keep: int, rank_state: RankState | None) -> Path:
        """Write the checkpoint of ``step`` (collective); its folder."""
        ...
