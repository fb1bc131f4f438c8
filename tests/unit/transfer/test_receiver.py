"""The receiver against malformed and hostile manifests (issue 11, item 4), in process.

Every case goes through :func:`recv_state` on a scripted transport: the receiver
must raise TransferError (nothing else) and answer the donor "rejected" (-1),
before it allocated anything the manifest asked for.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tests.unit.transfer.fakes import REJECTED, ScriptedDonor, queue_pair  # noqa: E402
from torchpass_slurm.errors import TransferError  # noqa: E402
from torchpass_slurm.transfer import materialize as materialize_mod  # noqa: E402
from torchpass_slurm.transfer.manifest import MAX_DEPTH, build_manifest  # noqa: E402
from torchpass_slurm.transfer.materialize import ALLOC_SLACK_BYTES, alloc_limit  # noqa: E402
from torchpass_slurm.transfer.stream import recv_state, send_state  # noqa: E402

TIMEOUT = timedelta(seconds=5)
GiB = 1 << 30


def small_state() -> dict[str, Any]:
    return {
        "model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.zeros(4)},
        "optim": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]},
        "step": 7,
    }


def base_doc() -> dict[str, Any]:
    manifest, _ = build_manifest(small_state(), chunk_bytes=16, digest_algo="crc32")
    return json.loads(manifest.to_json())


def tensor_node(doc: dict[str, Any]) -> dict[str, Any]:
    """The manifest node of model/w (the first tensor)."""
    return doc["tree"]["items"][0][1]["items"][0][1]


def reject(raw: bytes, match: str, into: Any = None) -> ScriptedDonor:
    """Send ``raw`` as the manifest; the receiver must refuse it with ``match`` and tell the donor."""
    donor = ScriptedDonor.with_manifest(raw)
    with pytest.raises(TransferError, match=match):
        recv_state(donor, timeout=TIMEOUT, into=into)
    assert donor.sent == [REJECTED], "the donor was not told that its manifest was rejected"
    return donor


def patched(edit: Any) -> bytes:
    doc = base_doc()
    edit(doc)
    return json.dumps(doc).encode()


def nested(depth: int) -> dict[str, Any]:
    node: dict[str, Any] = {"t": "list", "items": []}
    for _ in range(depth):
        node = {"t": "list", "items": [node]}
    return {"t": "dict", "items": [["deep", node]]}


def consistent(claim: int, *, dtype: str = "float32") -> bytes:
    """A manifest whose layout adds up: one tensor of ``claim`` bytes."""
    itemsize = {"float32": 4, "uint8": 1}[dtype]
    doc = base_doc()
    doc["tree"] = {
        "t": "dict",
        "items": [
            ["w", {"t": "tensor", "dtype": dtype, "shape": [claim // itemsize], "offset": 0, "nbytes": claim}]
        ],
    }
    doc.update(total_bytes=claim, chunk_bytes=4 << 20, n_chunks=-(-claim // (4 << 20)))
    return json.dumps(doc).encode()


@pytest.fixture
def allocations(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Bytes of every torch.empty this thread (the receiver) makes: tensors, staging, protocol buffers."""
    sizes: list[int] = []
    real = torch.empty
    me = threading.get_ident()

    def counting_empty(*shape: Any, dtype: Any = None, **kwargs: Any) -> Any:
        t = real(*shape, dtype=dtype, **kwargs)
        if threading.get_ident() == me:
            sizes.append(t.numel() * t.element_size())
        return t

    monkeypatch.setattr(torch, "empty", counting_empty)
    yield sizes


# --- every malformed manifest of issue 11 -------------------------------------------------------


@pytest.mark.parametrize("dtype", ["qint8", "quint4x2", "quint8", "qint32", "quint2x4"])
def test_a_quantized_dtype_is_refused_not_allocated(dtype: str, allocations: list[int]) -> None:
    def edit(doc: dict[str, Any]) -> None:
        tensor_node(doc)["dtype"] = dtype

    reject(patched(edit), f"dtype '{dtype}' at /model/w; this receiver accepts float64")
    assert max(allocations) <= 1 << 20  # only the header and the manifest's own bytes


@pytest.mark.parametrize(
    "dtype", ["float", "half", "bits8", "uint4", "int4", "float4_e2m1fn_x2", "Tensor", "__class__", ""]
)
def test_only_dense_dtypes_by_their_canonical_names(dtype: str) -> None:
    def edit(doc: dict[str, Any]) -> None:
        tensor_node(doc)["dtype"] = dtype

    reject(patched(edit), "this receiver accepts")


@pytest.mark.parametrize("text", ["zz", "0x1.8p+99999", "", "1" * 100, None, 1.5])
def test_bad_float_hex(text: Any) -> None:
    def edit(doc: dict[str, Any]) -> None:
        doc["tree"]["items"].append(["loss", {"t": "float", "hex": text}])

    reject(patched(edit), "malformed float|not float.hex")


@pytest.mark.parametrize(
    "shape", [[3.0, 4], ["3", 4], [True, 4], [-3, -4], [[3], 4], 12, None, [1] * 65, [2**63, 1]]
)
def test_non_integer_or_impossible_shapes(shape: Any) -> None:
    def edit(doc: dict[str, Any]) -> None:
        tensor_node(doc)["shape"] = shape

    reject(patched(edit), "malformed tensor at /model/w")


def test_a_shape_whose_size_overflows_the_layout() -> None:
    def edit(doc: dict[str, Any]) -> None:
        tensor_node(doc)["shape"] = [2**62, 2**62]

    reject(patched(edit), "layout is inconsistent at /model/w")


@pytest.mark.parametrize(
    "field, value", [("offset", 0.0), ("offset", -1), ("nbytes", "48"), ("nbytes", True), ("offset", None)]
)
def test_non_integer_offsets_and_sizes(field: str, value: Any) -> None:
    def edit(doc: dict[str, Any]) -> None:
        tensor_node(doc)[field] = value

    reject(patched(edit), "malformed tensor at /model/w")


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 900, 30_000])
def test_deep_nesting_of_the_tree(depth: int) -> None:
    def edit(doc: dict[str, Any]) -> None:
        doc["tree"] = nested(depth)

    if depth > 200:  # json.dumps itself may not get that deep: build the text by hand
        body = '{"t":"list","items":[' * depth + "]}" * depth
        raw = (
            json.dumps(base_doc())
            .replace('"tree": {', '"tree": {"t":"dict","items":[["deep",' + body + ']]}, "old": {', 1)
            .encode()
        )
        reject(raw, "nested too deeply|nests deeper")
    else:
        reject(patched(edit), f"nests deeper than {MAX_DEPTH} levels")


def test_deep_nesting_of_meta() -> None:
    def edit(doc: dict[str, Any]) -> None:
        meta: Any = 1
        for _ in range(MAX_DEPTH + 2):
            meta = [meta]
        doc["meta"] = meta

    reject(patched(edit), "meta nests deeper")


@pytest.mark.parametrize("claim", [64 * GiB, 256 * GiB, 1 << 40])
def test_a_consistent_manifest_claiming_gigabytes(claim: int, allocations: list[int]) -> None:
    reject(consistent(claim), f"claims {claim} bytes, of which receiving would allocate", into=small_state())
    assert sum(allocations) < 2 << 20, "the receiver allocated what the manifest claimed"


def test_the_claim_is_bounded_by_the_receiving_state() -> None:
    into = {"w": torch.zeros(1 << 20, dtype=torch.uint8)}  # 1 MiB
    limit = alloc_limit(into)
    assert limit == 4 * (1 << 20) + ALLOC_SLACK_BYTES
    reject(consistent(limit + 1, dtype="uint8"), f"this receiver allows {limit}", into=into)


def test_max_alloc_bytes_overrides_the_bound() -> None:
    donor = ScriptedDonor.with_manifest(consistent(1 << 20, dtype="uint8"))
    with pytest.raises(TransferError, match="this receiver allows 1000 "):
        recv_state(donor, timeout=TIMEOUT, max_alloc_bytes=1000)
    assert donor.sent == [REJECTED]


def test_a_list_as_the_root() -> None:
    def edit(doc: dict[str, Any]) -> None:
        doc["tree"] = {"t": "list", "items": []}

    reject(patched(edit), "root is a 'list' node, expected a dict node")


@pytest.mark.parametrize("root", [[], "x", 3, None])
def test_a_root_that_is_not_a_node(root: Any) -> None:
    def edit(doc: dict[str, Any]) -> None:
        doc["tree"] = root

    reject(patched(edit), "root is a JSON")


def test_a_json_list_as_the_document() -> None:
    reject(b"[1, 2]", "format 'list'")


@pytest.mark.parametrize("key", [True, False, None, 1.5, [1]])
def test_keys_that_are_not_str_or_int(key: Any) -> None:
    def edit(doc: dict[str, Any]) -> None:
        doc["tree"]["items"].append([key, 1])

    reject(patched(edit), "malformed dict item")


def test_a_repeated_key() -> None:
    def edit(doc: dict[str, Any]) -> None:
        doc["tree"]["items"].append(["step", 8])

    reject(patched(edit), "repeats the key 'step'")


@pytest.mark.parametrize(
    "raw, match",
    [
        (b'{"format": "torchpass-state/1", "meta": NaN}', "NaN is not JSON"),
        (b'{"format": "torchpass-state/1", "meta": -Infinity}', "Infinity is not JSON"),
        (b'{"format": "torchpass-state/1", "total_bytes": 1' + b"0" * 400 + b"}", "an integer of 401 digits"),
        (b"\xff\xfe", "not valid JSON"),
        (b"", "not valid JSON"),
    ],
)
def test_not_strict_json(raw: bytes, match: str) -> None:
    reject(raw, match)


@pytest.mark.parametrize("field", ["total_bytes", "chunk_bytes", "n_chunks"])
@pytest.mark.parametrize("value", [True, -1, 1.0, "16", 1 << 63])
def test_counts_must_be_ints(field: str, value: Any) -> None:
    def edit(doc: dict[str, Any]) -> None:
        doc[field] = value

    reject(patched(edit), f"{field} is .*, expected an int")


@pytest.mark.parametrize("algo", [["crc32"], {"a": 1}, None, 32])
def test_digest_algo_must_be_a_known_name(algo: Any) -> None:
    def edit(doc: dict[str, Any]) -> None:
        doc["digest_algo"] = algo

    reject(patched(edit), "digest algorithm")


def test_extra_fields_in_a_tensor_node() -> None:
    def edit(doc: dict[str, Any]) -> None:
        tensor_node(doc)["device"] = "cuda:0"

    reject(patched(edit), "malformed tensor")


# --- what still works ---------------------------------------------------------------------------


def transfer(state: dict[str, Any], into: Any = None, **recv: Any) -> dict[str, Any]:
    donor_end, receiver_end = queue_pair()
    errors: list[BaseException] = []

    def donor() -> None:
        try:
            send_state(donor_end, state, timeout=TIMEOUT, chunk_bytes=16)
        except BaseException as exc:  # reported to the test below
            errors.append(exc)

    thread = threading.Thread(target=donor)
    thread.start()
    try:
        received, _ = recv_state(receiver_end, timeout=TIMEOUT, into=into, **recv)
    finally:
        thread.join(10)
    assert not errors, errors
    return received


def test_a_spare_with_an_empty_optimizer_receives_the_moments() -> None:
    model = torch.nn.Linear(32, 32)
    opt = torch.optim.AdamW(model.parameters(), amsgrad=True)
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    spare_model = torch.nn.Linear(32, 32)
    spare_opt = torch.optim.AdamW(spare_model.parameters(), amsgrad=True)
    into = {"model": spare_model.state_dict(), "optim": spare_opt.state_dict()}
    got = transfer(
        {"model": model.state_dict(), "optim": opt.state_dict()},
        into,
        max_alloc_bytes=materialize_mod.ALLOC_FACTOR * materialize_mod.state_nbytes(into) + 1024,
    )
    expected = opt.state_dict()["state"][0]["max_exp_avg_sq"]
    assert torch.equal(got["optim"]["state"][0]["max_exp_avg_sq"], expected)


def test_the_receiver_allocates_no_more_than_it_computed(allocations: list[int]) -> None:
    state = small_state()
    manifest, _ = build_manifest(state, chunk_bytes=16, digest_algo="crc32")
    need = materialize_mod.allocation_bytes(manifest, None)
    allocations.clear()
    got = transfer(copy.deepcopy(state))
    protocol = 16 + len(manifest.to_json()) + 2 * 4 + 8 * 4  # header, manifest, digest buffers, ints
    assert 0 < sum(allocations) <= need + protocol
    assert torch.equal(got["model"]["w"], state["model"]["w"])


def test_the_donor_refuses_what_no_receiver_accepts() -> None:
    with pytest.raises(TransferError, match=r"cannot transfer the torch\.strided uint16 tensor at /x"):
        build_manifest({"x": torch.zeros(2, dtype=torch.uint16)}, chunk_bytes=16, digest_algo="crc32")
