"""The rank side of live migration for sharded training: FSDP2 ``fully_shard``, HSDP.

:class:`ShardedTrainer` is :class:`~torchpass_slurm.rank.elastic.ElasticTrainer` for a
model sharded on a ``DeviceMesh``. The user gives a builder instead of a model::

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
    rebuild     init_device_mesh on the new group; build(mesh); each rank copies its OWN
                local shards (parameters, optimizer state) from the old model into the new
                one: no communication, nothing gathered
    agree       all-gather (committed step, ranks leaving by a drain); S = the highest
    transfer    a rank behind S (the promoted spare) receives only its coordinate's shards:
                from the leaving rank (a drain) or a replica (rank/shard_handover.py);
                none of them: NoReplicaError (the job restarts from a checkpoint)

A rank leaving by a drain sends its own shards to the spare before it leaves
(:meth:`ShardedTrainer._release`), so pure FSDP drains live too. Per-rank randomness and
the data position must be functions of (seed, rank, step), as for ElasticTrainer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

from torchpass_slurm.control.bodies import Reconfigure
from torchpass_slurm.control.messages import ReportKind
from torchpass_slurm.errors import TransferError
from torchpass_slurm.mesh import MeshLayout
from torchpass_slurm.rank.elastic import ElasticTrainer
from torchpass_slurm.rank.group import adopt_subgroup_sockets, destroy_group, group_sockets, socket_inodes
from torchpass_slurm.rank.runtime import Runtime
from torchpass_slurm.rank.shard_handover import LeavingDonor, ShardHandover, shard_meta
from torchpass_slurm.rank.shard_state import check_specs, load_local_state, local_state

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["ShardedTrainer", "Builder"]

logger = logging.getLogger(__name__)

#: ``build(mesh) -> (model, optimizer)``: the model with ``fully_shard(..., mesh=mesh)``
#: applied, and its optimizer. Deterministic: the same layout on every call.
Builder = Callable[[Any], "tuple[nn.Module, torch.optim.Optimizer]"]


class ShardedTrainer(ElasticTrainer):
    """A sharded training loop that carries on through a lost or drained rank; see the module doc.

    The model and optimizer exist from :meth:`start` on (the mesh needs the process
    group); ``trainer.model`` and ``trainer.optimizer`` are replaced at every epoch, so the
    step function must use the model it is given.
    """

    def __init__(
        self,
        rt: Runtime,
        build: Builder,
        layout: MeshLayout,
        *,
        backend: str = "gloo",
        device_type: str = "cpu",
        start_step: int = 0,
        rank_state: Mapping[str, Any] | None = None,
    ) -> None:
        # No model yet: the mesh it is sharded on needs the group, which start() builds.
        super().__init__(
            rt,
            cast(Any, None),
            cast(Any, None),
            state={},
            backend=backend,
            start_step=start_step,
            rank_state=rank_state,
        )
        self.build = build
        self.layout = layout
        self.device_type = device_type
        self.mesh: Any = None
        self.shard_handover = ShardHandover(rt, layout)
        self._body: Reconfigure | None = None

    @property
    def received_state(self) -> bool:
        """True once this rank received its shards from a donor."""
        return self.shard_handover.received

    # -- the loop ------------------------------------------------------------
    def _get_ready(self) -> dict[str, Any]:
        """Build the mesh and the model before ``live_ready``, which says the mesh."""
        self._rebuild()
        return {"mesh": self.layout.to_json()}

    def _receive_live(self) -> None:
        """A spare promoted live receives its coordinate's shards."""
        self._handover()

    def resume_from_checkpoint(self, directory: Any) -> int:
        """Load this rank's newest shard checkpoint unless its shards came live; the step."""
        from torchpass_slurm.rank import shard_checkpoint

        if self.received_state or directory is None:
            return self.step
        own = self.rank_state.objects if self.rank_state is not None else None
        found = shard_checkpoint.load_latest(
            self.model, self.optimizer, self.layout, directory, rank_state=own
        )
        self.step = found or 0
        if self.rank_state is not None and found is not None:
            self.rank_state.capture(self.step)
        if self.rt.rank == 0:
            self.rt.report(ReportKind.RESUMED, step=self.step, epoch=self.rt.epoch)
        return self.step

    def save_checkpoint(self, directory: Any, step: int, keep: int = 3) -> Any:
        """Every rank writes its own shards of ``step`` (collective); the folder."""
        from torchpass_slurm.rank import shard_checkpoint

        own = self.rank_state.objects if self.rank_state is not None else None
        return shard_checkpoint.save(
            self.model, self.optimizer, self.layout, directory, step, keep=keep, rank_state=own
        )

    # -- recovery ------------------------------------------------------------
    def _reconfigure(self, body: Reconfigure) -> None:
        self._body = body  # _sync_state needs the ranks leaving by a drain
        try:
            super()._reconfigure(body)
        finally:
            self._body = None

    def _sync_state(self) -> None:
        """Rebuild on the new epoch's mesh, keep this rank's own shards, then the handover."""
        old = local_state(self.model, self.optimizer) if self.model is not None else None
        self._rebuild()
        if old is not None:
            state, specs = old
            check_specs(specs, _shapes(state), self.model, "the previous epoch's state of this rank")
            load_local_state(self.model, self.optimizer, state)
        self._handover()

    def _handover(self) -> None:
        body = self._body
        leaving = body.leave if body is not None and body.planned else ()
        self.step = self.shard_handover.sync(self.step, self.model, self.optimizer, leaving)

    def _rebuild(self) -> None:
        """The mesh on the current default group, and ``build(mesh)``; checks the mesh."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size() if dist.is_initialized() else 1
        if world != self.layout.world_size:
            raise TransferError(
                f"the mesh {self.layout.shape} needs {self.layout.world_size} ranks; this epoch has {world}",
                hint="a sharded job keeps its world size: every lost rank is taken by a spare",
            )
        self.model = self.optimizer = cast(Any, None)  # the old epoch's go with their mesh
        self.ddp_model = cast(Any, None)
        before = socket_inodes()
        self.mesh = init_device_mesh(self.device_type, self.layout.shape, mesh_dim_names=self.layout.dims)
        if self.backend == "gloo":  # the sub-groups' own sockets: the abort must reach them too
            info = self.rt.info
            stores = {int(info.store_port or 0), int(info.master_port or 0)} if info is not None else set()
            recorded = adopt_subgroup_sockets(group_sockets(before, exclude_ports=stores))
            self.rt.log.debug("mesh %s built; %d sockets recorded for an abort", self.layout.shape, recorded)
        self.model, self.optimizer = self.build(self.mesh)
        self.ddp_model = self.model

    def _release(self, body: Reconfigure) -> None:
        """This rank's node is drained: send its own shards to the spare taking its rank, leave.

        The shards are read before anything else (a local copy, no group needed); the old
        group goes first so no peer waits on it; the spare finds this rank through the
        store (``rank/shard_handover.py``). A handover that fails is logged: the spare's
        own handover then fails, and the supervisor decides the next step.
        """
        state, specs = local_state(self.model, self.optimizer)
        destroy_group(self.rt.log)
        try:
            seal = self.rt.transfer_seal(body.epoch, self.step, self.rt.rank, self.rt.rank)
            donor = LeavingDonor(
                self.rt.rank, body.epoch, body.store_addr, body.store_port, seal, self.rt.job_store
            )
            stats = donor.serve(state, shard_meta(self.layout, self.rt.rank, self.step, specs))
            self.rt.log.info("handed my shards of step %d to the spare: %s", self.step, stats)
        except TransferError as exc:
            self.rt.log.error("could not hand my shards of step %d to the spare: %s", self.step, exc)
        super()._release(body)

    def _wrap(self) -> None:
        """FSDP2 wraps in ``build``; the model's forward starts its collectives (SYNC), in a
        pre-forward hook of FSDP2's own, so this rank's hook must run before it: the rank state
        copy of the step leaves before the step's first collective."""
        self.ddp_model = self.model
        # first of the pre-forward hooks: FSDP2's own all-gathers in one registered before it
        self.model.register_forward_pre_hook(self._forward_called, prepend=True)


def _shapes(state: Any, path: str = "") -> dict[str, tuple[int, ...]]:
    """Path -> shape of every tensor of a local state (the manifest's paths)."""
    import torch

    if isinstance(state, torch.Tensor):
        return {path: tuple(state.shape)}
    out: dict[str, tuple[int, ...]] = {}
    if isinstance(state, dict):
        for key, value in state.items():
            out.update(_shapes(value, f"{path}/{key}"))
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            out.update(_shapes(value, f"{path}/{i}"))
    return out
