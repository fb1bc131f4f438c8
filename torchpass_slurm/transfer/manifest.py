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
import reprlib
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard

from torchpass_slurm.errors import TransferError
from torchpass_slurm.transfer.seal import CHUNK_MAC_BYTES, SEALED_DIGEST

if TYPE_CHECKING:
    from torchpass_slurm.transfer.seal import Seal

__all__ = [
    "Manifest",
    "TensorEntry",
    "DIGESTS",
    "DIGEST_SIZES",
    "chunk_digest",
    "DENSE_DTYPES",
    "FORMAT",
    "build_manifest",
    "MAX_CHUNK_BYTES",
    "MAX_DEPTH",
]

FORMAT = "torchpass-state/1"
#: Largest chunk a receiver accepts (bounds its staging memory).
MAX_CHUNK_BYTES = 1 << 30
#: Deepest nesting of the state tree (and of ``meta``) a receiver accepts; states are ~5 deep.
MAX_DEPTH = 64
#: Most dimensions a tensor may have (torch's own limit).
MAX_DIMS = 64
#: Largest size, offset or count in a manifest (and its digits, checked while parsing).
MAX_INT = (1 << 63) - 1
_MAX_INT_DIGITS = len(str(MAX_INT))
#: The only dtypes a receiver allocates, with their item size: dense floats, ints, bool, complex.
#: Quantized (qint8, quint4x2: torch.empty of those can crash), bit and sub-byte dtypes are refused.
DENSE_DTYPES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "complex128": 16,
    "complex64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


def _blake2b(data: memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _crc32(data: memoryview) -> bytes:
    return zlib.crc32(data).to_bytes(4, "little")


#: Chunk digest algorithms: name -> (digest size in bytes, function of the chunk's bytes).
DIGESTS: dict[str, tuple[int, Callable[[memoryview], bytes]]] = {
    "crc32": (4, _crc32),
    "blake2b-128": (16, _blake2b),
}
#: Every chunk digest a manifest may name -> its size: the unkeyed DIGESTS and the sealed MAC.
DIGEST_SIZES: dict[str, int] = {
    **{name: size for name, (size, _) in DIGESTS.items()},
    SEALED_DIGEST: CHUNK_MAC_BYTES,
}


def chunk_digest(algo: str, seal: Seal | None) -> tuple[int, Callable[[int, memoryview], bytes]]:
    """The digest size and function (chunk index, chunk bytes) -> digest of ``algo``."""
    if algo == SEALED_DIGEST:
        if seal is None:
            raise TransferError(f"the chunks are sealed ({algo}) but this end holds no key")
        return CHUNK_MAC_BYTES, seal.chunk_mac
    size, digest = DIGESTS[algo]
    return size, lambda _index, data: digest(data)


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
        """Parse and validate a manifest; TransferError says what is wrong.

        Nothing here allocates a tensor; every way the bytes can be wrong ends
        in a TransferError (docs/design/transfer.md lists the checks).
        """
        doc = _parse_json(data)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            seen = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise TransferError(
                f"the state manifest has format {seen!r}, expected {FORMAT!r}",
                hint="donor and receiver must run the same torchpass-slurm version",
            )
        algo = doc.get("digest_algo")
        if not isinstance(algo, str) or algo not in DIGEST_SIZES:
            raise TransferError(
                f"the state manifest uses digest algorithm {_show(algo)}; this receiver knows "
                f"{', '.join(sorted(DIGEST_SIZES))}",
                hint="donor and receiver must run the same torchpass-slurm version",
            )
        numbers: dict[str, int] = {}
        for key in ("total_bytes", "chunk_bytes", "n_chunks"):
            value = doc.get(key)
            if not _is_count(value):
                raise TransferError(
                    f"the state manifest's {key} is {_show(value)}, expected an int in 0..{MAX_INT}"
                )
            numbers[key] = value
        tree = doc.get("tree")
        if not (isinstance(tree, dict) and tree.get("t") == "dict"):
            raise TransferError(
                f"the state manifest's root is {_kind(tree)}, expected a dict node",
                hint="a state is a mapping (a dict of state dicts)",
            )
        entries: list[TensorEntry] = []
        _check_tree(tree, "", entries, 0)
        _check_plain(doc.get("meta"), "meta", 0)
        manifest = cls(
            tree,
            numbers["total_bytes"],
            numbers["chunk_bytes"],
            numbers["n_chunks"],
            algo,
            doc.get("meta"),
            tuple(entries),
        )
        _check_layout(manifest)
        return manifest


def _parse_json(data: bytes) -> Any:
    """Strict JSON: no NaN/Infinity, no integers beyond MAX_INT's digits; never RecursionError."""

    def refuse_constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        return json.loads(data.decode("utf-8"), parse_constant=refuse_constant, parse_int=_parse_int)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        why = "nested too deeply" if isinstance(exc, RecursionError) else f"{exc}"[:200]
        raise TransferError(
            f"the state manifest is not valid JSON: {why}",
            hint="donor and receiver must run the same torchpass-slurm version",
        ) from None


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def _is_count(value: Any) -> TypeGuard[int]:
    """A non-negative int a receiver can use as a size (bool is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_INT


_PREVIEW = reprlib.Repr()
_PREVIEW.maxlevel, _PREVIEW.maxstring, _PREVIEW.maxother, _PREVIEW.maxlist, _PREVIEW.maxdict = 3, 60, 60, 4, 6


def _show(value: Any) -> str:
    """A short repr of untrusted JSON for messages (bounded in length and depth)."""
    return _PREVIEW.repr(value)


def _kind(node: Any) -> str:
    if isinstance(node, dict):
        return f"a {str(node.get('t'))[:20]!r} node"
    return f"a JSON {type(node).__name__}"


# --- donor side: state -> manifest -------------------------------------------------


def build_manifest(
    state: Mapping[Any, Any], *, chunk_bytes: int, digest_algo: str, meta: Any = None
) -> tuple[Manifest, list[Any]]:
    """The manifest of ``state`` and its tensors in stream order."""
    if digest_algo not in DIGEST_SIZES:
        raise ValueError(f"unknown digest algorithm {digest_algo!r}; known: {sorted(DIGEST_SIZES)}")
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

    dtype = str(t.dtype).removeprefix("torch.")
    if t.layout != torch.strided or t.is_quantized or dtype not in DENSE_DTYPES:
        raise TransferError(
            f"cannot transfer the {t.layout} {dtype} tensor at {path}: only dense tensors of "
            f"{', '.join(DENSE_DTYPES)}",
            hint="convert it with .to_dense() / .dequantize() / .to(dtype) in state_dict()",
        )
    offset = entries[-1].offset + entries[-1].nbytes if entries else 0
    nbytes = t.numel() * t.element_size()
    entries.append(TensorEntry(path, dtype, tuple(t.shape), offset, nbytes))
    tensors.append(t)
    return {"t": "tensor", "dtype": dtype, "shape": list(t.shape), "offset": offset, "nbytes": nbytes}


# --- receiver side: validation and materialization ------------------------------------


def _check_tree(node: Any, path: str, entries: list[TensorEntry], depth: int) -> None:
    if depth > MAX_DEPTH:
        raise TransferError(
            f"the state manifest nests deeper than {MAX_DEPTH} levels at {path[:200]}",
            hint="a training state is a few levels deep; the donor is not a torchpass donor",
        )
    if node is None or isinstance(node, (bool, int, str)):
        return
    kind = node.get("t") if isinstance(node, dict) else None
    if kind == "float" and set(node) == {"t", "hex"}:
        _check_float_hex(node["hex"], path)
        return
    items = node.get("items") if isinstance(node, dict) else None
    if kind == "dict" and isinstance(items, list):
        seen: set[tuple[type, Any]] = set()
        for pair in items:
            if not (isinstance(pair, list) and len(pair) == 2 and _is_key(pair[0])):
                raise TransferError(
                    f"the state manifest has a malformed dict item at {path or '/'}: {_show(pair)}",
                    hint="items are [key, node] pairs with a str or int (not bool) key",
                )
            if (type(pair[0]), pair[0]) in seen:
                raise TransferError(f"the state manifest repeats the key {pair[0]!r:.80} at {path or '/'}")
            seen.add((type(pair[0]), pair[0]))
            _check_tree(pair[1], f"{path}/{pair[0]}", entries, depth + 1)
        return
    if kind in ("list", "tuple") and isinstance(items, list):
        for i, item in enumerate(items):
            _check_tree(item, f"{path}/{i}", entries, depth + 1)
        return
    if kind == "tensor":
        entries.append(_check_tensor_node(node, path))
        return
    raise TransferError(
        f"the state manifest has an unknown node at {path or '/'}: {_show(node)}",
        hint="donor and receiver must run the same torchpass-slurm version",
    )


def _is_key(key: Any) -> bool:
    return isinstance(key, str) or (isinstance(key, int) and not isinstance(key, bool))


def _check_float_hex(text: Any, path: str) -> None:
    if not isinstance(text, str) or len(text) > 40:
        raise TransferError(f"the state manifest has a malformed float at {path or '/'}: {_show(text)}")
    try:
        float.fromhex(text)
    except (ValueError, OverflowError):
        raise TransferError(
            f"the state manifest has a float at {path or '/'} that is not float.hex: {text!r}"
        ) from None


def _check_plain(value: Any, path: str, depth: int) -> None:
    """``meta``: plain JSON (NaN was refused by the parser), bounded nesting."""
    if depth > MAX_DEPTH:
        raise TransferError(f"the state manifest's {path} nests deeper than {MAX_DEPTH} levels")
    if isinstance(value, dict):
        for v in value.values():
            _check_plain(v, path, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _check_plain(v, path, depth + 1)


def _check_tensor_node(node: dict[str, Any], path: str) -> TensorEntry:
    dtype, shape = node.get("dtype"), node.get("shape")
    offset, nbytes = node.get("offset"), node.get("nbytes")
    if not (
        set(node) == {"t", "dtype", "shape", "offset", "nbytes"}
        and isinstance(shape, list)
        and len(shape) <= MAX_DIMS
        and all(_is_count(d) for d in shape)
        and _is_count(offset)
        and _is_count(nbytes)
    ):
        raise TransferError(
            f"the state manifest has a malformed tensor at {path}: {_show(node)}",
            hint=f"a tensor node has t, dtype, shape (at most {MAX_DIMS} ints >= 0), offset and nbytes",
        )
    if not isinstance(dtype, str) or dtype not in DENSE_DTYPES:
        raise TransferError(
            f"the state manifest has dtype {_show(dtype)} at {path}; this receiver accepts "
            f"{', '.join(DENSE_DTYPES)}",
            hint="quantized, sparse and other special tensors are not transferred",
        )
    assert isinstance(offset, int) and isinstance(nbytes, int)  # checked above, for the type checker
    return TensorEntry(path, dtype, tuple(shape), offset, nbytes)


def _check_layout(m: Manifest) -> None:
    expected = 0
    for e in m.entries:
        itemsize = DENSE_DTYPES[e.dtype]
        if e.offset != expected or e.nbytes != math.prod(e.shape) * itemsize:
            raise TransferError(
                f"the state manifest's layout is inconsistent at {e.path}: offset {e.offset} "
                f"(expected {expected}), {e.nbytes} bytes for shape {list(e.shape)} {e.dtype}"
            )
        expected += e.nbytes
        if expected > MAX_INT:
            raise TransferError(f"the state manifest's tensors claim more than {MAX_INT} bytes")
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
    """The torch dtype called ``name`` ("float32") if it is one of DENSE_DTYPES, else None."""
    import torch

    if not isinstance(name, str) or name not in DENSE_DTYPES:
        return None
    value = getattr(torch, name, None)
    return value if isinstance(value, torch.dtype) else None
