"""Flat buckets for state on a GPU (transfer/device_stage.py), with CPU tensors standing in.

A stand-in :class:`DeviceOps` says which CPU tensors play the GPU's and counts
the copies, so the planning, the gather and the scatter are checked here
bitwise against the host path; one round trip runs on a real GPU when there
is one (skipped otherwise: nothing in this file ran on a GPU on a CPU host).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tests.unit.transfer.fakes import QueueTransport, queue_pair  # noqa: E402
from torchpass_slurm.errors import TransferError  # noqa: E402
from torchpass_slurm.transfer.chunks import ChunkMap  # noqa: E402
from torchpass_slurm.transfer.device_stage import DeviceOps, plan_bucket  # noqa: E402
from torchpass_slurm.transfer.manifest import build_manifest  # noqa: E402
from torchpass_slurm.transfer.stream import recv_state, send_state  # noqa: E402
from torchpass_slurm.transfer.transport import Transport  # noqa: E402

TIMEOUT = timedelta(seconds=20)
CHUNK = 64  # the round trips' chunk size
GARBAGE = 0xAB  # what a fresh bucket holds: a byte the bucket did not carry shows up


class StandIn(DeviceOps):
    """CPU tensors named as on "gpu0" (or "gpu1"); every copy counted."""

    def __init__(self, gpu0: Iterable[Any] = (), gpu1: Iterable[Any] = ()) -> None:
        self.where = {id(t): "gpu0" for t in gpu0} | {id(t): "gpu1" for t in gpu1}
        self.transfers: list[int] = []  # bytes of each host <-> device copy
        self.copies = 0  # copies on a device
        self.waits = 0
        self.buckets: list[tuple[int, Any]] = []
        self.pinned: list[bool] = []

    def device_key(self, t: Any) -> Any:
        return self.where.get(id(t))

    def pin(self) -> bool:
        return True

    def host_buffer(self, nbytes: int, pinned: bool) -> Any:
        self.pinned.append(pinned)
        return torch.empty(nbytes, dtype=torch.uint8)

    def device_buffer(self, nbytes: int, device: Any) -> Any:
        self.buckets.append((nbytes, device))
        return torch.full((nbytes,), GARBAGE, dtype=torch.uint8)

    def copy(self, dst: Any, src: Any) -> None:
        self.copies += 1
        dst.copy_(src)

    def transfer(self, dst: Any, src: Any) -> None:
        self.transfers.append(src.numel())
        dst.copy_(src)

    def wait(self, device: Any) -> None:
        self.waits += 1


def mixed_state(seed: int = 0) -> dict[str, Any]:
    """Odd sizes and mixed dtypes: no tensor ends on a chunk boundary of the chunk sizes used."""
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(37, generator=g),  # float32, 148 bytes
        "b": torch.randn(5, 7, generator=g).to(torch.bfloat16),  # 70 bytes
        "c": torch.randint(-(2**40), 2**40, (13,), generator=g),  # int64, 104 bytes
        "d": torch.rand(11, generator=g) > 0.5,  # bool, 11 bytes
        "e": torch.randn(3, generator=g, dtype=torch.float64),  # 24 bytes
        "f": torch.randn(301, generator=g).to(torch.float16),  # 602 bytes: spans several chunks
        "g": torch.randint(0, 255, (1,), generator=g, dtype=torch.uint8),  # 1 byte
        "step": 7,
    }


def host_chunks(state: dict[str, Any], chunk: int) -> list[bytes]:
    """The stream's chunks as the host path (no device) cuts them: the reference."""
    manifest, tensors = build_manifest(state, chunk_bytes=chunk, digest_algo="crc32")
    cmap = ChunkMap(manifest, tensors)
    staging = torch.empty(chunk, dtype=torch.uint8)
    return [bytes(cmap.gather(i, staging).numpy()) for i in range(manifest.n_chunks)]


# --- planning (pure) -------------------------------------------------------------------------


def test_a_chunk_all_on_the_host_has_no_bucket() -> None:
    pieces = [(0, 10, 5, 0), (1, 0, 7, 5)]
    plan = plan_bucket(pieces, lambda i: None)
    assert plan.device is None and plan.bucket == () and plan.direct == tuple(pieces)


def test_the_bucket_spans_the_first_devices_pieces_and_leaves_the_rest_direct() -> None:
    pieces = [(0, 0, 4, 0), (1, 0, 3, 4), (2, 0, 6, 7), (3, 0, 2, 13), (4, 0, 9, 15)]
    where = {0: None, 1: "gpu0", 2: None, 3: "gpu0", 4: "gpu1"}
    plan = plan_bucket(pieces, where.__getitem__)
    assert plan.device == "gpu0"
    assert plan.bucket == ((1, 0, 3, 4), (3, 0, 2, 13))
    assert plan.direct == ((0, 0, 4, 0), (2, 0, 6, 7), (4, 0, 9, 15))
    assert (plan.lo, plan.hi) == (4, 15)


# --- gather and scatter, chunk by chunk --------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 7, 64, 100, 2000])
@pytest.mark.parametrize("on_gpu", ["all", "some", "two-devices"])
def test_gather_puts_every_chunk_together_as_the_host_path_does(chunk: int, on_gpu: str) -> None:
    state = mixed_state()
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    if on_gpu == "all":
        ops = StandIn(gpu0=tensors)
    elif on_gpu == "some":
        ops = StandIn(gpu0=tensors[::2])
    else:
        ops = StandIn(gpu0=tensors[::3], gpu1=tensors[1::3])
    manifest, stream_tensors = build_manifest(state, chunk_bytes=chunk, digest_algo="crc32")
    cmap = ChunkMap(manifest, stream_tensors, ops)
    staging = cmap.host_buffer(min(chunk, manifest.total_bytes))
    got = [bytes(cmap.gather(i, staging).numpy()) for i in range(manifest.n_chunks)]

    assert got == host_chunks(state, chunk)
    with_device = sum(1 for i in range(manifest.n_chunks) if cmap.stager.plan(cmap.pieces(i)).device)
    assert len(ops.transfers) == with_device, "one device-to-host copy per chunk that has GPU pieces"
    assert ops.pinned == [True]
    assert {size for size, _ in ops.buckets} == {min(chunk, manifest.total_bytes)}, "a bucket is one chunk"


def test_a_chunk_of_many_gpu_tensors_crosses_in_one_copy() -> None:
    state = {f"bias{i}": torch.full((3 + i,), float(i)) for i in range(40)}  # 40 small tensors
    ops = StandIn(gpu0=state.values())
    manifest, tensors = build_manifest(state, chunk_bytes=1 << 20, digest_algo="crc32")
    assert manifest.n_chunks == 1
    cmap = ChunkMap(manifest, tensors, ops)
    out = cmap.gather(0, cmap.host_buffer(manifest.total_bytes))
    assert bytes(out.numpy()) == host_chunks(state, 1 << 20)[0]
    assert ops.transfers == [manifest.total_bytes] and ops.copies == 40 and ops.waits == 1


@pytest.mark.parametrize("chunk", [1, 9, 64, 2000])
@pytest.mark.parametrize("on_gpu", ["all", "some", "two-devices"])
def test_scatter_fills_the_preallocated_gpu_tensors_bitwise(chunk: int, on_gpu: str) -> None:
    source = mixed_state(seed=1)
    into = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in source.items()}
    dests = [v for v in into.values() if isinstance(v, torch.Tensor)]
    ops = {
        "all": StandIn(gpu0=dests),
        "some": StandIn(gpu0=dests[1::2]),
        "two-devices": StandIn(gpu0=dests[::3], gpu1=dests[2::3]),
    }[on_gpu]
    manifest, _ = build_manifest(source, chunk_bytes=chunk, digest_algo="crc32")
    cmap = ChunkMap(manifest, dests, ops)
    for i, data in enumerate(host_chunks(source, chunk)):
        cmap.scatter(i, torch.frombuffer(bytearray(data), dtype=torch.uint8))
    cmap.finish()
    for key, value in source.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(into[key].view(torch.uint8), value.view(torch.uint8)), key
    with_device = sum(1 for i in range(manifest.n_chunks) if cmap.stager.plan(cmap.pieces(i)).device)
    assert len(ops.transfers) == with_device, "one host-to-device copy per chunk that has GPU pieces"


def test_the_host_path_is_untouched_without_a_device() -> None:
    state = mixed_state()
    ops = StandIn()
    manifest, tensors = build_manifest(state, chunk_bytes=64, digest_algo="crc32")
    cmap = ChunkMap(manifest, tensors, ops)
    staging = cmap.host_buffer(64)
    assert [bytes(cmap.gather(i, staging).numpy()) for i in range(manifest.n_chunks)] == host_chunks(
        state, 64
    )
    assert ops.pinned == [False], "host buffers are pinned only when the state meets a device"
    assert (ops.transfers, ops.copies, ops.buckets) == ([], 0, [])


def test_torchs_ops_see_cpu_tensors_as_host_memory() -> None:
    ops = DeviceOps()
    assert ops.device_key(torch.zeros(3)) is None
    ops.wait(torch.device("cpu"))  # nothing to wait for on the host
    buf = ops.host_buffer(16, pinned=False)
    assert buf.dtype == torch.uint8 and buf.numel() == 16 and not buf.is_pinned()
    src = torch.arange(16, dtype=torch.uint8)
    ops.transfer(buf, src)  # a blocking copy off CUDA: done when it returns
    assert torch.equal(buf, src)


# --- the stream: same bytes on the wire, a corrupted chunk still caught --------------------------


class Recorder(Transport):
    """A receiver that answers "start at 0" and "no bad chunk", and keeps every message sent."""

    name = "recorder"

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[bytes] = []

    def _send(self, buf: Any, timeout: timedelta) -> None:
        self.sent.append(bytes(buf.numpy()))

    def _recv(self, buf: Any, timeout: timedelta) -> None:
        buf.zero_()

    def close(self) -> None:
        pass


@pytest.mark.parametrize("digest", ["crc32", "blake2b-128"])
def test_the_wire_bytes_are_the_host_paths(digest: str) -> None:
    state = mixed_state(seed=2)
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    host, device = Recorder(), Recorder()
    send_state(host, state, timeout=TIMEOUT, chunk_bytes=50, digest_algo=digest)
    ops = StandIn(tensors)
    send_state(device, state, timeout=TIMEOUT, chunk_bytes=50, digest_algo=digest, device_ops=ops)
    assert device.sent == host.sent
    assert ops.transfers, "the device path ran"


def round_trip(
    source: dict[str, Any], into: dict[str, Any], donor_ops: DeviceOps, receiver_ops: DeviceOps, **kw: Any
) -> tuple[dict[str, Any], Any, Any]:
    donor_end, receiver_end = queue_pair()
    sent: list[Any] = []
    donor = threading.Thread(
        target=lambda: sent.append(
            send_state(donor_end, source, timeout=TIMEOUT, chunk_bytes=CHUNK, device_ops=donor_ops, **kw)
        )
    )
    donor.start()
    try:
        got, stats = recv_state(receiver_end, timeout=TIMEOUT, into=into, device_ops=receiver_ops)
    finally:
        donor.join(timeout=20)
    return got, stats, sent[0] if sent else None


def test_a_gpu_to_gpu_round_trip_is_bitwise_and_fills_in_place() -> None:
    source = mixed_state(seed=3)
    into = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in source.items()}
    donor_ops = StandIn(v for v in source.values() if isinstance(v, torch.Tensor))
    receiver_ops = StandIn(v for v in into.values() if isinstance(v, torch.Tensor))
    got, stats, _ = round_trip(source, into, donor_ops, receiver_ops)
    for key, value in source.items():
        if isinstance(value, torch.Tensor):
            assert got[key] is into[key], key
            assert torch.equal(got[key].view(torch.uint8), value.view(torch.uint8)), key
    assert got["step"] == 7
    assert len(donor_ops.transfers) == len(receiver_ops.transfers) == stats.chunks


def test_a_corrupted_gpu_chunk_is_caught_and_resent() -> None:
    source = mixed_state(seed=4)
    into = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in source.items()}
    donor_ops = StandIn(v for v in source.values() if isinstance(v, torch.Tensor))
    receiver_ops = StandIn(v for v in into.values() if isinstance(v, torch.Tensor))
    got, stats, sent = round_trip(source, into, donor_ops, receiver_ops, corrupt_chunks=(2, 9))
    assert stats.retries == 2 and sent.retries == 2
    for key, value in source.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key].view(torch.uint8), value.view(torch.uint8)), key


class FlipsFullChunks(QueueTransport):
    """The donor's end of a link that flips a byte of every full chunk, every time it is sent."""

    def _send(self, buf: Any, timeout: timedelta) -> None:
        if buf.numel() == CHUNK:
            buf = buf.clone()
            buf[5] ^= 0x01
        super()._send(buf, timeout)


def test_a_chunk_that_arrives_bad_every_time_fails_the_transfer_on_both_ends() -> None:
    source = mixed_state(seed=5)
    into = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in source.items()}
    donor_ops = StandIn(v for v in source.values() if isinstance(v, torch.Tensor))
    receiver_ops = StandIn(v for v in into.values() if isinstance(v, torch.Tensor))
    a: queue.Queue[bytes] = queue.Queue()
    b: queue.Queue[bytes] = queue.Queue()
    donor_end, receiver_end = FlipsFullChunks(a, b), QueueTransport(b, a)
    failed: list[BaseException] = []

    def donate() -> None:
        try:
            send_state(donor_end, source, timeout=TIMEOUT, chunk_bytes=CHUNK, device_ops=donor_ops)
        except TransferError as exc:
            failed.append(exc)

    donor = threading.Thread(target=donate)
    donor.start()
    with pytest.raises(TransferError, match="still failed their digest"):
        recv_state(receiver_end, timeout=TIMEOUT, into=into, device_ops=receiver_ops)
    donor.join(timeout=20)
    assert failed and "receiver gave up" in str(failed[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this host")
def test_a_cuda_round_trip_is_bitwise() -> None:  # pragma: no cover - runs only on a GPU host
    source = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in mixed_state(seed=6).items()}
    into = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in source.items()}
    got, _, _ = round_trip(source, into, DeviceOps(), DeviceOps())
    for key, value in source.items():
        if isinstance(value, torch.Tensor):
            assert got[key] is into[key] and got[key].is_cuda, key
            assert torch.equal(got[key].view(torch.uint8), value.view(torch.uint8)), key
