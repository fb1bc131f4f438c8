"""The manifest: a typed JSON description of a nested state dict, without pickle.

A state is a tree of dicts (keys ``str`` or ``int``: optimizer state uses int
keys), lists, tuples, tensors and JSON scalars. The manifest keeps the tree
and replaces every tensor by where its bytes are in one logical byte stream::

    {"format": "torchpass-state/1",
     "digest_algo": "crc32", "chunk_bytes": 4194304, "n_chunks": 3,
     "total_bytes": 9437184, "meta": {"step": 40},
     "tree": {"t": "dict", "items": [
        ["model", {"t": "dict", "items": [
            ["w", {"t": "tensor", "dtype": "float32", "shape": [1024, 1024],
                   "offset": 0, "nbytes": 4194304}]]}],
        [0, {"t": "tuple", "items": [1, "x", null, true, {"t": "float", "hex": "0x1.8p+0"}]}]]}}

Nodes: ``dict`` (items as ``[key, node]`` pairs, so int and str keys and their
order survive), ``list``, ``tuple``, ``tensor`` (dtype name, shape, offset and
size in the stream; tensors are laid out back to back in tree order), ``float``
(``float.hex``: exact, and NaN/inf stay strict JSON); ``None``, bools, ints and
strings are themselves. Anything else is refused with the path where it was
found. The manifest is serialized canonically, so two donors holding the same
state produce the same bytes and the same :meth:`Manifest.digest`.
"""

from __future__ import annotations

import hashlib
import json
import math
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torchpass_slurm.errors import TransferError

__all__ = ["Manifest", "TensorEntry", "DIGESTS", "FORMAT", "build_manifest", "materialize", "MAX_CHUNK_BYTES"]

FORMAT = "torchpass-state/1"
#: Largest chunk a receiver accepts (bounds its staging memory).
MAX_CHUNK_BYTES = 1 << 30


def _blake2b(data: memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _crc32(data: memoryview) -> bytes:
    return zlib.crc32(data).to_bytes(4, "little")


#: Chunk digest algorithms: name -> (digest size in bytes, function of the chunk's bytes).
DIGESTS: dict[str, tuple[int, Callable[[memoryview], bytes]]] = {
    "crc32": (4, _crc32),
    "blake2b-128": (16, _blake2b),
}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are in the stream."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Manifest:
    """What a donor is about to send: the state's tree, its byte layout, chunking and digest."""

    tree: Any
    total_bytes: int
    chunk_bytes: int
    n_chunks: int
    digest_algo: str
    meta: Any = None
    entries: tuple[TensorEntry, ...] = field(default=(), compare=False, repr=False)

    def to_json(self) -> bytes:
        """Canonical JSON bytes (sorted keys, no spaces)."""
        doc = {
            "format": FORMAT,
            "tree": self.tree,
            "total_bytes": self.total_bytes,
            "chunk_bytes": self.chunk_bytes,
            "n_chunks": self.n_chunks,
            "digest_algo": self.digest_algo,
            "meta": self.meta,
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()

    def digest(self) -> str:
        """sha256 of :meth:`to_json`: equal for donors that hold the same state."""
        return hashlib.sha256(self.to_json()).hexdigest()

    def chunk_span(self, index: int) -> tuple[int, int]:
        """Byte range ``[start, end)`` of chunk ``index`` in the stream."""
        start = index * self.chunk_bytes
        return start, min(start + self.chunk_bytes, self.total_bytes)

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Parse and validate a manifest; TransferError says what is wrong."""
        try:
            doc = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise TransferError(
                f"the state manifest is not valid JSON: {exc}",
                hint="donor and receiver must run the same torchpass-slurm version",
            ) from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            seen = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise TransferError(
                f"the state manifest has format {seen!r}, expected {FORMAT!r}",
                hint="donor and receiver must run the same torchpass-slurm version",
            )
        algo = doc.get("digest_algo")
        if algo not in DIGESTS:
            raise TransferError(
                f"the state manifest uses digest algorithm {algo!r}; this receiver knows "
                f"{', '.join(sorted(DIGESTS))}",
                hint="donor and receiver must run the same torchpass-slurm version",
            )
        numbers: dict[str, int] = {}
        for key in ("total_bytes", "chunk_bytes", "n_chunks"):
            value = doc.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise TransferError(f"the state manifest's {key} is {value!r}, expected a non-negative int")
            numbers[key] = value
        entries: list[TensorEntry] = []
        _check_tree(doc.get("tree"), "", entries)
        manifest = cls(
            doc["tree"],
            numbers["total_bytes"],
            numbers["chunk_bytes"],
            numbers["n_chunks"],
            algo,
            doc.get("meta"),
            tuple(entries),
        )
        _check_layout(manifest)
        return manifest


# --- donor side: state -> manifest -------------------------------------------------


def build_manifest(
    state: Mapping[Any, Any], *, chunk_bytes: int, digest_algo: str, meta: Any = None
) -> tuple[Manifest, list[Any]]:
    """The manifest of ``state`` and its tensors in stream order."""
    if digest_algo not in DIGESTS:
        raise ValueError(f"unknown digest algorithm {digest_algo!r}; known: {sorted(DIGESTS)}")
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in 1..{MAX_CHUNK_BYTES}, got {chunk_bytes}")
    if not isinstance(state, Mapping):
        raise TransferError(f"a state must be a mapping, got {type(state).__name__}")
    tensors: list[Any] = []
    entries: list[TensorEntry] = []
    tree = _encode(state, "", tensors, entries)
    total = sum(e.nbytes for e in entries)
    try:
        json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TransferError(f"meta must be plain JSON (no NaN): {exc}") from None
    manifest = Manifest(
        tree, total, chunk_bytes, math.ceil(total / chunk_bytes), digest_algo, meta, tuple(entries)
    )
    return manifest, tensors


def _encode(obj: Any, path: str, tensors: list[Any], entries: list[TensorEntry]) -> Any:
    import torch

    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return {"t": "float", "hex": obj.hex()}
    if isinstance(obj, torch.Tensor):
        return _encode_tensor(obj, path, tensors, entries)
    if isinstance(obj, Mapping):
        items = []
        for key, value in obj.items():
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise TransferError(
                    f"state key {key!r} at {path or '/'} is a {type(key).__name__}; "
                    "only str and int keys can be transferred"
                )
            items.append([key, _encode(value, f"{path}/{key}", tensors, entries)])
        return {"t": "dict", "items": items}
    if isinstance(obj, (list, tuple)):
        kind = "tuple" if isinstance(obj, tuple) else "list"
        return {"t": kind, "items": [_encode(v, f"{path}/{i}", tensors, entries) for i, v in enumerate(obj)]}
    raise TransferError(
        f"cannot transfer a {type(obj).__name__} at {path or '/'}",
        hint="state dicts may hold tensors, dicts, lists, tuples, str, int, float, bool "
        "and None; turn other objects into those in your state_dict()",
    )


def _encode_tensor(t: Any, path: str, tensors: list[Any], entries: list[TensorEntry]) -> dict[str, Any]:
    import torch

    if t.layout != torch.strided or t.is_quantized:
        raise TransferError(
            f"cannot transfer the {t.layout} tensor at {path}: only dense tensors",
            hint="convert it with .to_dense() / .dequantize() in state_dict()",
        )
    offset = entries[-1].offset + entries[-1].nbytes if entries else 0
    nbytes = t.numel() * t.element_size()
    dtype = str(t.dtype).removeprefix("torch.")
    entries.append(TensorEntry(path, dtype, tuple(t.shape), offset, nbytes))
    tensors.append(t)
    return {"t": "tensor", "dtype": dtype, "shape": list(t.shape), "offset": offset, "nbytes": nbytes}


# --- receiver side: validation and materialization ------------------------------------


def _check_tree(node: Any, path: str, entries: list[TensorEntry]) -> None:
    if node is None or isinstance(node, (bool, int, str)):
        return
    kind = node.get("t") if isinstance(node, dict) else None
    if kind == "float" and isinstance(node.get("hex"), str):
        return
    if kind == "dict" and isinstance(node.get("items"), list):
        for pair in node["items"]:
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], (str, int))):
                raise TransferError(
                    f"the state manifest has a malformed dict item at {path or '/'}: {pair!r:.80}"
                )
            _check_tree(pair[1], f"{path}/{pair[0]}", entries)
        return
    if kind in ("list", "tuple") and isinstance(node.get("items"), list):
        for i, item in enumerate(node["items"]):
            _check_tree(item, f"{path}/{i}", entries)
        return
    if kind == "tensor":
        entries.append(_check_tensor_node(node, path))
        return
    raise TransferError(
        f"the state manifest has an unknown node at {path or '/'}: {node!r:.80}",
        hint="donor and receiver must run the same torchpass-slurm version",
    )


def _check_tensor_node(node: dict[str, Any], path: str) -> TensorEntry:
    dtype, shape = node.get("dtype"), node.get("shape")
    offset, nbytes = node.get("offset"), node.get("nbytes")
    if not (
        isinstance(shape, list)
        and all(isinstance(d, int) and d >= 0 for d in shape)
        and isinstance(offset, int)
        and isinstance(nbytes, int)
    ):
        raise TransferError(f"the state manifest has a malformed tensor at {path}: {node!r:.120}")
    if not isinstance(dtype, str) or dtype_of(dtype) is None:
        raise TransferError(f"the state manifest has an unknown dtype {dtype!r} at {path}")
    return TensorEntry(path, dtype, tuple(shape), offset, nbytes)


def _check_layout(m: Manifest) -> None:
    expected = 0
    for e in m.entries:
        itemsize = dtype_of(e.dtype).itemsize
        if e.offset != expected or e.nbytes != math.prod(e.shape) * itemsize:
            raise TransferError(
                f"the state manifest's layout is inconsistent at {e.path}: offset {e.offset} "
                f"(expected {expected}), {e.nbytes} bytes for shape {list(e.shape)} {e.dtype}"
            )
        expected += e.nbytes
    if expected != m.total_bytes:
        raise TransferError(
            f"the state manifest says total_bytes={m.total_bytes} but its tensors hold {expected}"
        )
    if not 0 < m.chunk_bytes <= MAX_CHUNK_BYTES:
        raise TransferError(
            f"the state manifest's chunk_bytes={m.chunk_bytes} is outside 1..{MAX_CHUNK_BYTES}"
        )
    if m.n_chunks != math.ceil(m.total_bytes / m.chunk_bytes):
        raise TransferError(
            f"the state manifest says n_chunks={m.n_chunks}, but {m.total_bytes} bytes in "
            f"{m.chunk_bytes}-byte chunks make {math.ceil(m.total_bytes / m.chunk_bytes)}"
        )


def dtype_of(name: Any) -> Any:
    """The torch dtype called ``name`` ("float32"), or None."""
    import torch

    value = getattr(torch, name, None) if isinstance(name, str) else None
    return value if isinstance(value, torch.dtype) else None


def materialize(manifest: Manifest, into: Any = None) -> tuple[Any, list[Any]]:
    """Build the state the manifest describes and its destination tensors in stream order.

    A contiguous tensor of ``into`` at the same path with the same dtype and
    shape is reused (filled in place later, on its own device); other tensors
    are allocated on the CPU.
    """
    tensors: list[Any] = []
    return _decode(manifest.tree, into, tensors), tensors


def _decode(node: Any, into: Any, tensors: list[Any]) -> Any:
    if node is None or isinstance(node, (bool, int, str)):
        return node
    kind = node["t"]
    if kind == "float":
        return float.fromhex(node["hex"])
    if kind == "dict":
        sub = into if isinstance(into, Mapping) else {}
        return {key: _decode(value, sub.get(key), tensors) for key, value in node["items"]}
    if kind in ("list", "tuple"):
        seq = into if isinstance(into, (list, tuple)) else ()
        items = [_decode(v, seq[i] if i < len(seq) else None, tensors) for i, v in enumerate(node["items"])]
        return tuple(items) if kind == "tuple" else items
    return _destination(node, into, tensors)


def _destination(node: dict[str, Any], into: Any, tensors: list[Any]) -> Any:
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
    else:
        tensor = torch.empty(shape, dtype=dtype)
    tensors.append(tensor)
    return tensor
