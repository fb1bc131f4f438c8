"""Property-based tests of manifest decoding (hypothesis).

- any bytes and any JSON document decode to a Manifest or raise TransferError, never anything else;
- a valid manifest with one subtree replaced by arbitrary JSON: the same, and when it still
  decodes, what the receiver would allocate is computed without allocating and without error;
- any state of dense tensors and scalars survives build -> JSON -> decode -> materialize.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from torchpass_slurm.errors import TransferError  # noqa: E402
from torchpass_slurm.transfer.manifest import DENSE_DTYPES, Manifest, build_manifest  # noqa: E402
from torchpass_slurm.transfer.materialize import allocation_bytes, materialize  # noqa: E402

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)
#: JSON shaped like manifest nodes, so that mutations reach the deeper checks.
node_like = st.recursive(
    json_scalars | st.fixed_dictionaries({"t": st.just("float"), "hex": st.text(max_size=12) | json_scalars}),
    lambda inner: (
        st.fixed_dictionaries(
            {
                "t": st.sampled_from(["dict", "list", "tuple", "tensor", "x"]),
                "items": st.lists(st.lists(inner, max_size=3) | inner, max_size=3),
            }
        )
        | st.fixed_dictionaries(
            {
                "t": st.just("tensor"),
                "dtype": st.sampled_from([*DENSE_DTYPES, "qint8", "quint4x2", "float", ""]),
                "shape": st.lists(st.integers(-2, 2**40) | json_scalars, max_size=4),
                "offset": st.integers(-1, 64) | json_scalars,
                "nbytes": st.integers(-1, 2**45) | json_scalars,
            }
        )
        | json_values
    ),
    max_leaves=12,
)


def decode(raw: bytes) -> Manifest | None:
    """Manifest.from_json, with TransferError as None; anything else fails the test."""
    try:
        return Manifest.from_json(raw)
    except TransferError:
        return None


@SETTINGS
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_raise_transfer_error(raw: bytes) -> None:
    decode(raw)


@SETTINGS
@given(json_values)
def test_any_json_document_decodes_or_raises_transfer_error(doc: Any) -> None:
    decode(json.dumps(doc).encode())


def valid_doc() -> dict[str, Any]:
    state = {
        "model": {"w": torch.ones(2, 3), "b": torch.zeros(3, dtype=torch.int64)},
        "optim": {
            "state": {0: {"step": torch.tensor(1.0)}},
            "param_groups": [{"lr": 0.5, "betas": (0.9, 1.0)}],
        },
    }
    manifest, _ = build_manifest(state, chunk_bytes=8, digest_algo="crc32")
    return json.loads(manifest.to_json())


def subtrees(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(node, dict):
        for key, value in node.items():
            out += subtrees(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += subtrees(value, (*path, i))
    return out


@SETTINGS
@given(st.data())
def test_a_mutated_manifest_is_refused_or_bounded(data: st.DataObject) -> None:
    doc = valid_doc()
    path = data.draw(st.sampled_from(subtrees(doc)[1:]))
    parent = doc
    for step in path[:-1]:
        parent = parent[step]
    parent[path[-1]] = data.draw(node_like)
    manifest = decode(json.dumps(doc).encode())
    if manifest is not None:  # still consistent: the dry run must work and agree with the layout
        need = allocation_bytes(manifest, None)
        assert need == manifest.total_bytes + 2 * min(manifest.chunk_bytes, manifest.total_bytes)
        if need <= 1 << 20:
            _, tensors = materialize(manifest, None)
            assert sum(t.numel() * t.element_size() for t in tensors) == manifest.total_bytes


dense = st.sampled_from(sorted(DENSE_DTYPES))
tensors = st.builds(
    lambda dtype, shape: torch.zeros(shape, dtype=getattr(torch, dtype)),
    dense,
    st.lists(st.integers(0, 3), max_size=3),
)
leaves = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.text(max_size=5) | st.floats() | tensors
)
keys = st.text(max_size=5) | st.integers(-3, 3)
states = st.dictionaries(
    keys,
    st.recursive(
        leaves,
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.lists(inner, max_size=3).map(tuple)
            | st.dictionaries(keys, inner, max_size=3)
        ),
        max_leaves=10,
    ),
    max_size=4,
)


def same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert list(a) == list(b) and [type(k) for k in a] == [type(k) for k in b]
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same(x, y)
    elif isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
    elif isinstance(a, float):
        assert a.hex() == b.hex() or (math.isnan(a) and math.isnan(b))
    else:
        assert a == b


@SETTINGS
@given(states, st.integers(1, 64))
def test_every_dense_state_round_trips_through_the_manifest(state: dict[Any, Any], chunk: int) -> None:
    manifest, _ = build_manifest(state, chunk_bytes=chunk, digest_algo="crc32")
    decoded = Manifest.from_json(manifest.to_json())
    assert decoded == manifest and decoded.entries == manifest.entries
    rebuilt, _ = materialize(decoded, None)
    same(rebuilt, state)
