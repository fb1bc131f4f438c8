"""The receiver's side of a manifest: how much memory it takes, the bound, the state itself.

A validated :class:`~torchpass_slurm.transfer.manifest.Manifest` is turned into
the state it describes in two passes over the same walk: a dry run that counts
the bytes the receive would allocate (tensors that cannot be filled in place
in ``into``, plus the two staging chunks), checked against the receiver's
bound, and only then the real pass that allocates.

The bound comes from the receiving state itself. A replica of the same
training has the same model, so the model's tensors are filled in place and
allocate nothing; what a spare lacks is mostly optimizer state, which an
optimizer keeps per parameter (AdamW: two moments; with amsgrad, three)::

    bound = ALLOC_FACTOR x (bytes of the tensors in into) + ALLOC_SLACK_BYTES

A manifest that would allocate more is refused before anything is allocated:
a donor of another model, a bug, or a forged manifest claiming a terabyte.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchpass_slurm.errors import TransferError
from torchpass_slurm.transfer.manifest import Manifest, dtype_of

__all__ = [
    "ALLOC_FACTOR",
    "ALLOC_SLACK_BYTES",
    "allocation_bytes",
    "alloc_limit",
    "check_allocation",
    "materialize",
    "state_nbytes",
]

#: Bytes a receive may allocate per byte of tensors the receiving state already holds
#: (a spare's empty optimizer receives up to 3 buffers per parameter: AdamW with amsgrad).
ALLOC_FACTOR = 4
#: Bytes a receive may allocate beyond that: RNG states, small buffers, the staging chunks.
ALLOC_SLACK_BYTES = 64 << 20
#: Staging buffers per side (double buffering), see stream.py.
STAGING_BUFFERS = 2


def state_nbytes(state: Any) -> int:
    """Bytes held by the tensors of ``state`` (dicts, lists and tuples walked; tensors on any device)."""
    import torch

    total, stack, seen = 0, [state], set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen:  # tied weights count once; a cycle ends
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            total += obj.numel() * obj.element_size()
        elif isinstance(obj, Mapping):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
    return total


def alloc_limit(into: Any) -> int:
    """The most bytes receiving into ``into`` may allocate: ALLOC_FACTOR x its size + ALLOC_SLACK_BYTES."""
    return ALLOC_FACTOR * state_nbytes(into) + ALLOC_SLACK_BYTES


def allocation_bytes(manifest: Manifest, into: Any = None) -> int:
    """Bytes receiving ``manifest`` into ``into`` would allocate (new tensors, staging); allocates nothing."""
    sizes: list[int] = []
    _decode(manifest.tree, into, [], sizes)
    staging = STAGING_BUFFERS * min(manifest.chunk_bytes, manifest.total_bytes)
    return sum(sizes) + staging


def check_allocation(manifest: Manifest, into: Any, limit: int) -> None:
    """Raise TransferError unless receiving ``manifest`` allocates at most ``limit`` bytes."""
    need = allocation_bytes(manifest, into)
    if need > limit:
        raise TransferError(
            f"the state manifest claims {manifest.total_bytes} bytes, of which receiving would "
            f"allocate {need}; this receiver allows {limit} (its own state holds "
            f"{state_nbytes(into)} bytes)",
            hint="the donor must hold a replica of this rank's state (same model and optimizer); "
            "pass max_alloc_bytes= to recv_state if a larger state is expected",
        )


def materialize(manifest: Manifest, into: Any = None) -> tuple[Any, list[Any]]:
    """Build the state the manifest describes and its destination tensors in stream order.

    A contiguous tensor of ``into`` at the same path with the same dtype and
    shape is reused (filled in place later, on its own device); other tensors
    are allocated on the CPU. Call :func:`check_allocation` first.
    """
    tensors: list[Any] = []
    return _decode(manifest.tree, into, tensors, None), tensors


def _decode(node: Any, into: Any, tensors: list[Any], dry_run: list[int] | None) -> Any:
    """The value of ``node``; with ``dry_run`` (a list) tensors are not allocated, their sizes appended."""
    if node is None or isinstance(node, (bool, int, str)):
        return node
    kind = node["t"]
    if kind == "float":
        return float.fromhex(node["hex"])
    if kind == "dict":
        sub = into if isinstance(into, Mapping) else {}
        return {key: _decode(value, sub.get(key), tensors, dry_run) for key, value in node["items"]}
    if kind in ("list", "tuple"):
        seq = into if isinstance(into, (list, tuple)) else ()
        items = [
            _decode(v, seq[i] if i < len(seq) else None, tensors, dry_run)
            for i, v in enumerate(node["items"])
        ]
        return tuple(items) if kind == "tuple" else items
    return _destination(node, into, tensors, dry_run)


def _destination(node: dict[str, Any], into: Any, tensors: list[Any], dry_run: list[int] | None) -> Any:
    import torch

    dtype, shape = dtype_of(node["dtype"]), tuple(node["shape"])
    if (
        isinstance(into, torch.Tensor)
        and into.dtype == dtype
        and tuple(into.shape) == shape
        and into.layout == torch.strided
        and into.is_contiguous()
    ):
        tensor = into
    elif dry_run is not None:
        dry_run.append(node["nbytes"])
        return None
    else:
        tensor = torch.empty(shape, dtype=dtype)
    tensors.append(tensor)
    return tensor
