"""The training state of a data-parallel (DDP) rank: full state_dicts, identical on every replica.

:class:`ReplicatedState` is the :class:`~torchpass_slurm.rank.training_state.TrainingState`
that :class:`~torchpass_slurm.rank.elastic.ElasticTrainer` gets from its public constructor
``ElasticTrainer(rt, model, optimizer, state=...)``. DDP is the mesh ``("replicate",)`` of the
world: every rank at the agreed step holds the whole state, so a receiver takes donor
``i % len(donors)`` in rank order, a drained rank just leaves (a replica serves the spare),
and the model lives across epochs (only its DDP wrapper is built again).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from torchpass_slurm.mesh import MeshLayout
from torchpass_slurm.rank.rankstate import RANK_STATE_KEY

if TYPE_CHECKING:
    import torch
    from torch import nn

    from torchpass_slurm.rank.rankstate import RankState
    from torchpass_slurm.rank.training_state import Accept

__all__ = ["ReplicatedState", "DEFAULT_DDP_KWARGS", "with_rank_state"]

#: The keyword arguments of every DDP wrap (the first, and the fresh one after each migration);
#: ``ElasticTrainer(ddp_kwargs=...)`` overrides them key by key. ``find_unused_parameters=True``
#: is here for bitwise determinism, not for unused parameters: it is the one setting under which
#: DDP never rebuilds its buckets. Without it DDP puts every parameter in one bucket for a wrap's
#: first step and rebuilds the buckets in gradient-ready order before the second, so the first
#: step after a re-wrap (or a resume) reduces on another layout than the same step of a run never
#: re-wrapped, and gloo sums an element in an order set by its place in the bucket. Measured with
#: ``python -m benchmarks.experiments.ddp_determinism`` (torch 2.13 CPU, gloo, 3 processes, tiny_gpt d_model
#: 128, 2 layers, AdamW, 30 steps): with the defaults, ``static_graph=True``,
#: ``bucket_cap_mb=1024`` or ``gradient_as_bucket_view=True``, both a run re-wrapped before steps
#: 10 and 20 and fresh processes resuming at step 10 first differ at step 10 and end with ~380,000
#: of 466,432 parameters different; with ``find_unused_parameters=True`` all three runs end
#: bitwise equal. So does one parameter per bucket (``bucket_cap_mb_list=[1e-6]``, a torch 2.13
#: keyword that Debian's torch 2.6 lacks), at 1.3 to 2.3 times the step time. The extra
#: autograd-graph traversal of ``find_unused_parameters=True`` did not show above the noise of a
#: shared 2-core host: 3 runs measured the defaults -11 %, -29 % and +9 % against it.
DEFAULT_DDP_KWARGS: Mapping[str, Any] = MappingProxyType({"find_unused_parameters": True})


class ReplicatedState:
    """A DDP rank's model, optimizer and ``state`` (name -> Stateful); see the module doc."""

    avoid: Collection[int] = ()  # donors in plain rank order: donor i % len(donors)
    leaving_donor = False
    resumable = True

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        state: Mapping[str, Any],
        ddp_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self._model = model
        self._optimizer = optimizer
        self._state = dict(state)
        self.ddp_kwargs = {**DEFAULT_DDP_KWARGS, **(ddp_kwargs or {})}

    @property
    def model(self) -> nn.Module:
        return self._model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    @property
    def state(self) -> dict[str, Any]:
        return self._state

    def layout(self, world_size: int) -> MeshLayout:
        return MeshLayout.ddp(world_size)

    def ready(self) -> dict[str, Any]:
        return {}

    def renew(self) -> None:
        """The model and optimizer live across epochs: nothing to rebuild."""

    def wrap(self, on_forward: Callable[..., None]) -> nn.Module | None:
        """A fresh DDP on the current group (None: one rank, no wrap)."""
        import torch.distributed as dist

        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return None
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(self._model, **self.ddp_kwargs)
        wrapped.register_forward_pre_hook(on_forward)
        return wrapped

    def _state_dicts(self) -> dict[str, Any]:
        return {name: obj.state_dict() for name, obj in self._state.items()}

    def outgoing(self, rank: int, step: int) -> tuple[Mapping[str, Any], Any]:
        return self._state_dicts(), {"step": step}

    def incoming(self, rank: int, donor: int, step: int) -> tuple[Mapping[str, Any], Accept | None]:
        return self._state_dicts(), None

    def load(self, received: Mapping[str, Any]) -> None:
        for name, obj in self._state.items():
            obj.load_state_dict(received[name])

    def agreement_fields(
        self, holders: list[int], plan: Mapping[int, int], leaving: Collection[int]
    ) -> dict[str, Any]:
        """Every rank at the agreed step is a donor: each holds the whole state."""
        return {"donors": holders}

    def transfer_fields(self, via: str) -> dict[str, Any]:
        return {}

    def load_checkpoint(self, directory: Any, rank_state: RankState | None) -> int | None:
        from torchpass_slurm.rank import checkpoint

        return checkpoint.load_latest(with_rank_state(self._state, rank_state), directory)

    def save_checkpoint(self, directory: Any, step: int, keep: int, rank_state: RankState | None) -> Path:
        from torchpass_slurm.rank import checkpoint

        return checkpoint.save(with_rank_state(self._state, rank_state), directory, step, keep=keep)


def with_rank_state(state: dict[str, Any], rank_state: RankState | None) -> dict[str, Any]:
    """What a checkpoint of a rank holds: ``state`` (itself: a load fills it in place), and the
    rank state beside it."""
    if rank_state is None:
        return state
    return {**state, RANK_STATE_KEY: rank_state.checkpoint_entry()}
