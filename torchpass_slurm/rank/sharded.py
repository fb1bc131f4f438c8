"""The training state of a sharded rank (FSDP2 ``fully_shard``, HSDP), and ``ShardedTrainer``.

:func:`ShardedTrainer` is :class:`~torchpass_slurm.rank.elastic.ElasticTrainer` configured
with a :class:`ShardedState`: the same loop, recovery and handover, on a model sharded on a
``DeviceMesh``. The user gives a builder instead of a model::

    def build(mesh):                      # called once per epoch, on that epoch's mesh
        model = Model()                   # the same seed on every rank
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters())

    trainer = ShardedTrainer(rt, build, MeshLayout(("replicate", "shard"), (2, 2)))
    trainer.fit(train_step, steps)        # train_step(step, model): forward + backward

A mesh's sub-groups belong to one epoch's process group, so after every reconfigure::

    rejoin      destroy the broken group, build the epoch's group (same world, same ranks)
    renew       init_device_mesh on the new group; build(mesh); each rank copies its OWN
                local shards (parameters, optimizer state) from the old model into the new
                one: no communication, nothing gathered
    agree       all-gather (committed step, ranks leaving by a drain); S = the highest
    transfer    a rank behind S (the promoted spare) receives only its coordinate's shards:
                from the leaving rank (a drain) or a replica (rank/handover.py), judged
                against its own mesh and model first (rank/shard_state.py);
                none of them: NoReplicaError (the job restarts from a checkpoint)

A rank leaving by a drain sends its own shards to the spare before it leaves
(``leaving_donor``), so pure FSDP drains live too. Per-rank randomness and the data
position must be functions of (seed, rank, step), as for ElasticTrainer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchpass_slurm.errors import TorchpassError, TransferError
from torchpass_slurm.mesh import MeshLayout
from torchpass_slurm.rank.backends import choose_backend
from torchpass_slurm.rank.elastic import ElasticTrainer
from torchpass_slurm.rank.group import adopt_subgroup_sockets, group_sockets, socket_inodes
from torchpass_slurm.rank.runtime import Runtime
from torchpass_slurm.rank.shard_state import (
    check_specs,
    judge_shard_manifest,
    load_local_state,
    local_shapes,
    local_state,
    shard_meta,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

    from torchpass_slurm.rank.rankstate import RankState
    from torchpass_slurm.rank.training_state import Accept
    from torchpass_slurm.transfer import Manifest

__all__ = ["ShardedTrainer", "ShardedState", "Builder"]

logger = logging.getLogger(__name__)

#: ``build(mesh) -> (model, optimizer)``: the model with ``fully_shard(..., mesh=mesh)``
#: applied, and its optimizer. Deterministic: the same layout on every call.
Builder = Callable[[Any], "tuple[nn.Module, torch.optim.Optimizer]"]


def ShardedTrainer(  # a constructor's name: the public API's since the first release
    rt: Runtime,
    build: Builder,
    layout: MeshLayout,
    *,
    backend: str = "gloo",
    device_type: str = "cpu",
    start_step: int = 0,
    rank_state: Mapping[str, Any] | None = None,
) -> ElasticTrainer:
    """The trainer of a model sharded on ``layout`` by ``build``; see the module doc.

    The model and optimizer exist from :meth:`~ElasticTrainer.start` on (the mesh needs the
    process group); ``trainer.model`` and ``trainer.optimizer`` are replaced at every epoch,
    so the step function must use the model it is given.
    """
    backend = choose_backend(backend, device_type)  # "auto": NCCL on CUDA (rank/backends.py)
    training = ShardedState(rt, build, layout, backend=backend, device_type=device_type)
    return ElasticTrainer.with_training_state(
        rt, training, backend=backend, start_step=start_step, rank_state=rank_state
    )


class ShardedState:
    """A sharded rank's model and optimizer, built on every epoch's mesh; see the module doc."""

    avoid: Collection[int] = (0,)  # rank 0 (the batch host's) donates only as the last choice
    leaving_donor = True
    resumable = False  # every epoch builds new tensors: a cut receive starts over

    def __init__(
        self,
        rt: Runtime,
        build: Builder,
        layout: MeshLayout,
        *,
        backend: str = "gloo",
        device_type: str = "cpu",
    ) -> None:
        self.rt = rt
        self.build = build
        self.mesh_layout = layout
        self.backend = backend
        self.device_type = device_type
        self.mesh: Any = None
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None

    @property
    def model(self) -> nn.Module:
        if self._model is None:
            raise TorchpassError(
                "the sharded model is built on the epoch's mesh, which needs the process group",
                hint="call trainer.start() (or fit) before using trainer.model",
            )
        return self._model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        if self._optimizer is None:
            raise TorchpassError(
                "the sharded model's optimizer is built on the epoch's mesh, which needs the process group",
                hint="call trainer.start() (or fit) before using trainer.optimizer",
            )
        return self._optimizer

    @property
    def state(self) -> dict[str, Any]:
        return {}  # a sharded checkpoint is written by save_checkpoint, one file per rank

    def layout(self, world_size: int) -> MeshLayout:
        return self.mesh_layout

    # -- the epoch -----------------------------------------------------------
    def ready(self) -> dict[str, Any]:
        """Build the mesh and the model before ``live_ready``, which says the mesh."""
        self._rebuild()
        return {"mesh": self.mesh_layout.to_json()}

    def renew(self) -> None:
        """Rebuild on the new epoch's mesh and keep this rank's own shards (a local copy)."""
        old = local_state(self._model, self.optimizer) if self._model is not None else None
        self._rebuild()
        if old is not None:
            state, specs = old
            check_specs(specs, local_shapes(state), self.model, "the previous epoch's state of this rank")
            load_local_state(self.model, self.optimizer, state)

    def _rebuild(self) -> None:
        """The mesh on the current default group, and ``build(mesh)``; checks the mesh."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        layout = self.mesh_layout
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world != layout.world_size:
            raise TransferError(
                f"the mesh {layout.shape} needs {layout.world_size} ranks; this epoch has {world}",
                hint="a sharded job keeps its world size: every lost rank is taken by a spare",
            )
        self._model = self._optimizer = None  # the old epoch's go with their mesh
        before = socket_inodes()
        self.mesh = init_device_mesh(self.device_type, layout.shape, mesh_dim_names=layout.dims)
        if self.backend == "gloo":  # the sub-groups' own sockets: the abort must reach them too
            info = self.rt.info
            stores = {int(info.store_port or 0), int(info.master_port or 0)} if info is not None else set()
            recorded = adopt_subgroup_sockets(group_sockets(before, exclude_ports=stores))
            self.rt.log.debug("mesh %s built; %d sockets recorded for an abort", layout.shape, recorded)
        self._model, self._optimizer = self.build(self.mesh)

    def wrap(self, on_forward: Callable[..., None]) -> nn.Module | None:
        """FSDP2 wraps in ``build``; the model's forward starts its collectives (SYNC), in a
        pre-forward hook of FSDP2's own, so ``on_forward`` must run before it: the rank state
        copy of the step leaves before the step's first collective."""
        # first of the pre-forward hooks: FSDP2's own all-gathers in one registered before it
        self.model.register_forward_pre_hook(on_forward, prepend=True)
        return None

    # -- the handover: this rank's own shards, judged before they are loaded ---------------
    def outgoing(self, rank: int, step: int) -> tuple[Mapping[str, Any], Any]:
        state, specs = local_state(self.model, self.optimizer)
        return state, shard_meta(self.mesh_layout, rank, step, specs)

    def incoming(self, rank: int, donor: int, step: int) -> tuple[Mapping[str, Any], Accept | None]:
        into, _ = local_state(self.model, self.optimizer)  # this rank's own shards: filled in place
        model = self.model

        def accept(manifest: Manifest) -> None:
            judge_shard_manifest(manifest, self.mesh_layout, rank, donor, step, model)

        return into, accept

    def load(self, received: Mapping[str, Any]) -> None:
        load_local_state(self.model, self.optimizer, received)

    def agreement_fields(
        self, holders: list[int], plan: Mapping[int, int], leaving: Collection[int]
    ) -> dict[str, Any]:
        """The donors the plan uses (each holds one shard coordinate), and the leaving ranks."""
        return {"donors": sorted(set(plan.values())), "leaving": sorted(leaving)}

    def transfer_fields(self, via: str) -> dict[str, Any]:
        return {"via": via}

    # -- checkpoints ---------------------------------------------------------
    def load_checkpoint(self, directory: Any, rank_state: RankState | None) -> int | None:
        """This rank's newest shard checkpoint (and its own state); the step, None if there is none."""
        from torchpass_slurm.rank import shard_checkpoint

        own = rank_state.objects if rank_state is not None else None
        return shard_checkpoint.load_latest(
            self.model, self.optimizer, self.mesh_layout, directory, rank_state=own
        )

    def save_checkpoint(self, directory: Any, step: int, keep: int, rank_state: RankState | None) -> Path:
        """Every rank writes its own shards of ``step`` (collective); the folder."""
        from torchpass_slurm.rank import shard_checkpoint

        own = rank_state.objects if rank_state is not None else None
        return shard_checkpoint.save(
            self.model, self.optimizer, self.mesh_layout, directory, step, keep=keep, rank_state=own
        )
