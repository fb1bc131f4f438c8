"""A sharded rank's own state: its local shards as plain tensors, with what they are a shard of.

FSDP2 (``fully_shard``) keeps every parameter as a ``DTensor`` whose local tensor is this
rank's shard; AdamW's moments are DTensors of the same layout. This module turns the
rank's model and optimizer into a state of plain local tensors that the transfer stream
and the shard checkpoint can carry (no pickle), plus a *spec* per tensor::

    state  {"model": {fqn: local},
            "optim": {"state": {fqn: {"exp_avg": local, "exp_avg_sq": local, "step": t}},
                      "param_groups": [{"lr": 0.001, ..., "params": [fqn, ...]}]}}
    specs  {"/model/<fqn>": {"global_shape": [...], "stride": [...],
                             "placements": ["Replicate()", "Shard(dim=0)"]}, ...}

The path of a spec is the path of its tensor in the transfer manifest. A tensor that is
no DTensor (AdamW's ``step``, a parameter outside every ``fully_shard``) has no spec.

Loading goes back through ``DTensor.from_local`` on the *receiving* model's mesh with the
receiving parameter's own placements, global shape and stride, after :func:`check_specs`
found them equal to the sender's. Measured on torch 2.13 (CPU, gloo, 2x2 and 1x4 meshes):
``get_model_state_dict`` / ``get_optimizer_state_dict`` with ``full_state_dict=False`` and
``set_model_state_dict`` / ``set_optimizer_state_dict`` run no collective (they work with
no process group at all), so a rank copies its shards from the old epoch's model into
the new one alone, with the old group already destroyed; ``set_optimizer_state_dict`` on
a fresh optimizer first runs one step with zero gradients and ``lr=0`` to create the
state, then overwrites it, and the training continues bitwise equal to a run never
rebuilt (``tests/unit/sharded``).

A shard is taken, judged and loaded here: :func:`shard_meta` is what a donor's manifest says
its shards are (the step, the mesh, the donor's coordinate, the specs), and
:func:`judge_shard_manifest` the receiver's check of it against its own mesh and freshly
built model before one byte is written (the handover's and the shard checkpoint's).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torchpass_slurm.errors import TransferError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from torchpass_slurm.mesh import MeshLayout
    from torchpass_slurm.transfer import Manifest

__all__ = [
    "local_state",
    "load_local_state",
    "expected_specs",
    "check_specs",
    "spec_of",
    "state_bytes",
    "shard_meta",
    "judge_shard_manifest",
    "local_shapes",
]


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=False)


def spec_of(t: Any) -> dict[str, Any] | None:
    """A DTensor's place in its global tensor (JSON); None for a plain tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return None
    return {
        "global_shape": list(t.shape),
        "stride": list(t.stride()),
        "placements": [str(p) for p in t.placements],
    }


def _unwrap(obj: Any, path: str, specs: dict[str, Any]) -> Any:
    """``obj`` with every DTensor replaced by its local tensor; specs recorded by path."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        spec = spec_of(obj)
        specs[path] = spec
        return obj.to_local().detach()
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, Mapping):
        return {k: _unwrap(v, f"{path}/{k}", specs) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_unwrap(v, f"{path}/{i}", specs) for i, v in enumerate(obj)]
        return tuple(items) if isinstance(obj, tuple) else items
    return obj


def reshard(model: nn.Module) -> None:
    """Put every FSDP module back in its sharded state (local; a failed step may leave the
    parameters unsharded, and only the sharded ones are this rank's state)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's own shards (model and optimizer) as plain tensors, and their specs.

    No communication: the tensors are views of the rank's own shards, nothing is gathered.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    reshard(model)
    specs: dict[str, Any] = {}
    state = {
        "model": _unwrap(get_model_state_dict(model, options=_options()), "/model", specs),
        "optim": _unwrap(get_optimizer_state_dict(model, optimizer, options=_options()), "/optim", specs),
    }
    return state, specs


def expected_specs(model: nn.Module) -> dict[str, dict[str, Any] | None]:
    """The spec of each of ``model``'s state-dict entries (parameters and persistent buffers),
    by FQN: what a donor's shard of this rank must look like."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {fqn: spec_of(t) for fqn, t in get_model_state_dict(model, options=_options()).items()}


def check_specs(
    specs: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], model: nn.Module, what: str
) -> None:
    """Raise TransferError unless the tensors described (``specs`` by path, ``shapes`` their
    local shapes) are this rank's shards of ``model``: the same FQNs, and for each sharded
    tensor the same global shape, stride, placements and local shape as the rank's own
    parameter. Optimizer tensors (``/optim/state/<fqn>/<key>``) must match their parameter.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    own = get_model_state_dict(model, options=_options())
    theirs = {p.removeprefix("/model/") for p in shapes if p.startswith("/model/")}
    if theirs != set(own):
        missing, extra = sorted(set(own) - theirs), sorted(theirs - set(own))
        raise TransferError(
            f"{what} holds other tensors than this rank's model: "
            f"missing {missing[:8]}, unexpected {extra[:8]}",
            hint="donor and receiver must build the same model (the same build function and arguments)",
        )
    for path, shape in shapes.items():
        fqn = _fqn_of(path)
        if fqn is None:
            continue
        if fqn not in own:
            raise TransferError(f"{what} has optimizer state {path} for {fqn!r}, which this model lacks")
        mine = own[fqn]
        spec = specs.get(path)
        if spec != spec_of(mine) or tuple(shape) != _local_shape(mine):
            raise TransferError(
                f"{what} does not hold this rank's shard at {path}: it has {spec} with a local shape "
                f"{list(shape)}; this rank's {fqn!r} is {spec_of(mine)} with a local shape "
                f"{list(_local_shape(mine))}",
                hint="the donor must hold this rank's shard coordinate on a mesh of the same shape",
            )


def _fqn_of(path: str) -> str | None:
    """The parameter FQN a sharded tensor's path belongs to; None for a tensor without one."""
    if path.startswith("/model/"):
        return path.removeprefix("/model/")
    if path.startswith("/optim/state/"):
        fqn, _, key = path.removeprefix("/optim/state/").rpartition("/")
        return fqn if key != "step" else None
    return None


def _local_shape(t: Any) -> tuple[int, ...]:
    from torch.distributed.tensor import DTensor

    return tuple(t.to_local().shape if isinstance(t, DTensor) else t.shape)


def _rewrap(obj: Any, template: Any) -> Any:
    """A local tensor as a DTensor laid out as the receiving model's ``template``."""
    from torch.distributed.tensor import DTensor

    if not isinstance(template, DTensor):
        return obj
    return DTensor.from_local(
        obj,
        template.device_mesh,
        template.placements,
        shape=template.shape,
        stride=template.stride(),
        run_check=False,
    )


def load_local_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Load a state of :func:`local_state`'s form (checked by :func:`check_specs`) into a
    model and optimizer built on this epoch's mesh. Local: no communication."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    own = get_model_state_dict(model, options=_options())
    model_sd = {fqn: _rewrap(t, own[fqn]) for fqn, t in state["model"].items()}
    optim = state["optim"]
    optim_sd: dict[str, Any] = {
        "state": {
            fqn: {k: _rewrap(v, own[fqn]) if k != "step" else v for k, v in per_param.items()}
            for fqn, per_param in optim["state"].items()
        },
        "param_groups": [dict(group) for group in optim["param_groups"]],
    }
    set_model_state_dict(model, model_sd, options=_options())
    set_optimizer_state_dict(model, optimizer, optim_sd, options=_options())


def state_bytes(state: Any) -> int:
    """Bytes of the tensors of a local state (what a transfer of it moves)."""
    from torchpass_slurm.transfer.materialize import state_nbytes

    return state_nbytes(state)


def local_shapes(state: Any, path: str = "") -> dict[str, tuple[int, ...]]:
    """Path -> shape of every tensor of a local state (the manifest's paths)."""
    import torch

    if isinstance(state, torch.Tensor):
        return {path: tuple(state.shape)}
    out: dict[str, tuple[int, ...]] = {}
    if isinstance(state, dict):
        for key, value in state.items():
            out.update(local_shapes(value, f"{path}/{key}"))
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            out.update(local_shapes(value, f"{path}/{i}"))
    return out


# --- what a shard transfer says it carries, and the receiver's judgement of it -----------


def shard_meta(layout: MeshLayout, rank: int, step: int, specs: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest's ``meta`` of a shard transfer: the step and what the shards are."""
    return {
        "step": step,
        "shards": {
            "mesh": layout.to_json(),
            "rank": rank,
            "coord": list(layout.coord(rank)),
            "specs": dict(specs),
        },
    }


def judge_shard_manifest(
    manifest: Manifest, layout: MeshLayout, rank: int, donor: int, step: int, model: nn.Module
) -> None:
    """Raise TransferError unless ``manifest`` holds ``donor``'s shards of step ``step`` and
    they are the shards of this rank's coordinate on this rank's mesh and model."""
    meta = manifest.meta if isinstance(manifest.meta, dict) else {}
    shards = meta.get("shards")
    if not isinstance(shards, dict):
        raise TransferError(
            f"the state from rank {donor} carries no shard metadata; this rank is sharded",
            hint="donor and receiver must both run ShardedTrainer of the same torchpass-slurm version",
        )
    if meta.get("step") != step:
        raise TransferError(
            f"rank {donor} sent the state of step {meta.get('step')!r}; the agreed step is {step}"
        )
    if shards.get("mesh") != layout.to_json():
        raise TransferError(
            f"rank {donor} sent shards of the mesh {shards.get('mesh')!r}; "
            f"this rank's mesh is {layout.to_json()}",
            hint="every rank of the job must build the same mesh layout",
        )
    coord = shards.get("coord")
    if shards.get("rank") != donor or coord != list(layout.coord(donor)):
        raise TransferError(
            f"the shards sent as rank {donor}'s say rank {shards.get('rank')!r} at {coord!r}; "
            f"rank {donor} sits at {list(layout.coord(donor))} of {list(layout.shape)}"
        )
    if layout.shard_coord(donor) != layout.shard_coord(rank):
        raise TransferError(
            f"rank {donor} at {coord} holds another shard than rank {rank} at {list(layout.coord(rank))}",
            hint="a donor must hold the same shard coordinate in another replica group",
        )
    specs = shards.get("specs")
    if not isinstance(specs, dict):
        raise TransferError(f"the shard metadata from rank {donor} has no tensor specs")
    check_specs(specs, {e.path: e.shape for e in manifest.entries}, model, f"the state from rank {donor}")
