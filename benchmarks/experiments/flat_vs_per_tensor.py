"""Flat chunks against one message per tensor, for a model of hundreds of tensors, in one run.

    python -m benchmarks.experiments.flat_vs_per_tensor                     # 400 tensors, ~300 MB
    python -m benchmarks.experiments.flat_vs_per_tensor --tensors 400 --mb 300 --repeat 2 --json F

Two processes on this host over 127.0.0.1 (rank 0 receives and times, rank 1
sends), on the existing transports: ``SocketTransport`` (TCP) and
``TorchTransport`` on a gloo group. The state is a model of ``--tensors``
tensors (per layer: a weight of odd size, its bias and a norm's weight and
bias; float32 and bfloat16), about ``--mb`` MB; the receiver fills
pre-allocated tensors in place in every row. Rows, per transport:

* ``per-tensor`` (the baseline): one message per tensor, as torchft's
  PGTransport and naive code send a state dict (``isend`` of each tensor's
  bytes, two in flight; the receiver posts the next tensor's ``irecv`` before
  it waits for this one); no checksum, no manifest;
* ``per-tensor+crc32``: the same, each tensor followed by its crc32, checked on
  arrival (the integrity the stream has);
* ``flat-raw``: the tensors' bytes back to back, cut into 4 MiB chunks that span
  tensors (``ChunkMap``: zero-copy inside one tensor, else two staging
  buffers), no checksum: the same granularity as the stream, nothing else;
* ``flat``: ``send_state``/``recv_state``: those chunks each with its crc32, the
  manifest, the answers (the product's path).

This measures message granularity on host memory. On a GPU the flat path also
saves one device copy and one synchronisation per tensor (transfer/device_stage.py);
that is not measured here (docs/gpu.md says what ran where).

This is a script, not a test: numbers depend on the machine; never assert on them.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from benchmarks import manifest
from benchmarks.transfer_bench import Peer, gloo_group, socket_transport
from torchpass_slurm.transfer import TorchTransport, recv_state, send_state
from torchpass_slurm.transfer.chunks import ChunkMap, byte_view
from torchpass_slurm.transfer.manifest import build_manifest

MB = 1_000_000
CHUNK = 4 << 20  # the stream's default chunk
TIMEOUT = timedelta(seconds=300)
ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensors", type=int, default=400, help="tensors in the state (a multiple of 4)")
    p.add_argument("--mb", type=int, default=300, help="about this many MB in all (default 300)")
    p.add_argument("--repeat", type=int, default=3, help="runs per row; the best is kept (default 3)")
    p.add_argument("--json", type=Path, help="write the result here (benchmarks/results/...: recorded)")
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--role", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def make_state(n_tensors: int, total_mb: int, fill: bool) -> dict[str, torch.Tensor]:
    """A model-like state: per layer a weight (odd sizes, 0.4x to 1.6x the mean), a bias and a
    norm's weight and bias; every fourth layer in bfloat16. The same sizes on both ranks."""
    layers = max(n_tensors // 4, 1)
    hidden = [1024 + 61 * (i % 9) for i in range(layers)]
    scale = [0.4 + 1.2 * ((7 * i) % layers) / max(layers - 1, 1) for i in range(layers)]
    per_layer = total_mb * MB / layers
    state: dict[str, torch.Tensor] = {}
    for i in range(layers):
        dtype = torch.bfloat16 if i % 4 == 3 else torch.float32
        size = torch.tensor([], dtype=dtype).element_size()
        rows = max(int(per_layer * scale[i] / size / hidden[i]), 1)
        make = torch.randn if fill else torch.empty
        state[f"layers.{i}.weight"] = make(rows, hidden[i]).to(dtype)
        state[f"layers.{i}.bias"] = make(rows).to(dtype)
        state[f"layers.{i}.norm.weight"] = make(hidden[i]).to(dtype)
        state[f"layers.{i}.norm.bias"] = make(hidden[i]).to(dtype)
    return state


def per_tensor(transport: Any, rank: int, state: dict[str, torch.Tensor]) -> float | None:
    """One message per tensor, two in flight; the receiver's seconds."""
    views = [byte_view(t) for t in state.values()]
    began = time.perf_counter()
    if rank == 0:
        pending = transport.irecv(views[0], TIMEOUT)
        for view in views[1:]:
            following = transport.irecv(view, TIMEOUT)
            pending.wait(TIMEOUT)
            pending = following
        pending.wait(TIMEOUT)
        return time.perf_counter() - began
    inflight: deque[Any] = deque()
    for view in views:
        if len(inflight) >= 2:
            inflight.popleft().wait(TIMEOUT)
        inflight.append(transport.isend(view, TIMEOUT))
    while inflight:
        inflight.popleft().wait(TIMEOUT)
    return None


def _crc(view: torch.Tensor) -> torch.Tensor:
    import zlib

    return torch.frombuffer(bytearray(zlib.crc32(view.numpy().data).to_bytes(4, "little")), dtype=torch.uint8)


def per_tensor_crc(transport: Any, rank: int, state: dict[str, torch.Tensor]) -> float | None:
    """One message per tensor and one for its crc32, two tensors in flight; the receiver's seconds."""
    views = [byte_view(t) for t in state.values()]
    began = time.perf_counter()
    if rank == 0:
        crcs = [torch.empty(4, dtype=torch.uint8) for _ in range(2)]

        def post(k: int) -> tuple[Any, Any]:
            return transport.irecv(views[k], TIMEOUT), transport.irecv(crcs[k % 2], TIMEOUT)

        pending = post(0)
        for k in range(len(views)):
            following = post(k + 1) if k + 1 < len(views) else None
            pending[0].wait(TIMEOUT)
            pending[1].wait(TIMEOUT)
            if not torch.equal(_crc(views[k]), crcs[k % 2]):
                raise RuntimeError(f"tensor {k} failed its crc32")
            if following is not None:
                pending = following
        return time.perf_counter() - began
    inflight: deque[tuple[Any, Any]] = deque()
    for view in views:
        if len(inflight) >= 2:
            for handle in inflight.popleft():
                handle.wait(TIMEOUT)
        inflight.append((transport.isend(view, TIMEOUT), transport.isend(_crc(view), TIMEOUT)))
    while inflight:
        for handle in inflight.popleft():
            handle.wait(TIMEOUT)
    return None


def flat_raw(transport: Any, rank: int, state: dict[str, torch.Tensor]) -> float | None:
    """The stream's chunks without digests, manifest or answers; the receiver's seconds."""
    m, tensors = build_manifest(state, chunk_bytes=CHUNK, digest_algo="crc32")
    cmap = ChunkMap(m, tensors)
    staging = [torch.empty(min(CHUNK, m.total_bytes), dtype=torch.uint8) for _ in range(2)]
    began = time.perf_counter()
    if rank == 0:
        pending: tuple[int, torch.Tensor, bool, Any] | None = None
        for i in range(m.n_chunks):
            direct = cmap.direct(i)
            start, end = m.chunk_span(i)
            target = direct if direct is not None else staging[i % 2][: end - start]
            handle = transport.irecv(target, TIMEOUT)
            if pending is not None:
                _place(cmap, *pending)
            pending = (i, target, direct is None, handle)
        if pending is not None:
            _place(cmap, *pending)
        return time.perf_counter() - began
    inflight: deque[Any] = deque()
    for i in range(m.n_chunks):
        if len(inflight) >= 2:
            inflight.popleft().wait(TIMEOUT)
        data = cmap.direct(i)
        inflight.append(
            transport.isend(data if data is not None else cmap.gather(i, staging[i % 2]), TIMEOUT)
        )
    while inflight:
        inflight.popleft().wait(TIMEOUT)
    return None


def _place(cmap: ChunkMap, index: int, data: torch.Tensor, staged: bool, handle: Any) -> None:
    handle.wait(TIMEOUT)
    if staged:
        cmap.scatter(index, data)


def flat(transport: Any, rank: int, state: dict[str, torch.Tensor]) -> float | None:
    """The stream; the receiver's seconds."""
    if rank == 0:
        began = time.perf_counter()
        got, _ = recv_state(transport, timeout=TIMEOUT, into=state)
        assert all(got[k] is v for k, v in state.items()), "received in place"
        return time.perf_counter() - began
    send_state(transport, state, timeout=TIMEOUT)
    return None


def check_equal(peer: Peer, state: dict[str, torch.Tensor], sent: dict[str, torch.Tensor] | None) -> bool:
    """After a row: the receiver's tensors bitwise equal the donor's (a digest through the store)."""
    import hashlib

    h = hashlib.sha256()
    for t in (sent if sent is not None else state).values():
        h.update(byte_view(t).numpy().tobytes())
    peer.store.set(f"digest{peer._n}/{peer.rank}", h.hexdigest())
    peer.barrier()
    return bool(peer.store.get(f"digest{peer._n - 1}/0") == peer.store.get(f"digest{peer._n - 1}/1"))


def run_rank(args: argparse.Namespace, rank: int) -> None:
    torch.set_num_threads(1)
    peer = Peer(rank, "127.0.0.1", args.port)
    sent = make_state(args.tensors, args.mb, fill=True) if rank == 1 else None
    into = make_state(args.tensors, args.mb, fill=False) if rank == 0 else None
    state = sent if sent is not None else into
    assert state is not None
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    links = {"socket": socket_transport(peer), "torch (gloo)": TorchTransport(1 - rank, gloo_group(peer))}
    rows: list[dict[str, Any]] = []
    load_at_start = round(os.getloadavg()[0], 2)  # others' work on the host shows in the numbers
    if rank == 0:
        print(f"{len(state)} tensors, {nbytes / MB:.1f} MB; best of {args.repeat}; receiver's time")
        print(f"{'transport':<14} {'method':<17} {'seconds':>8} {'MB/s':>7}  bitwise", flush=True)
    methods: list[tuple[str, Callable[[Any, int, dict[str, torch.Tensor]], float | None]]] = [
        ("per-tensor", per_tensor),
        ("per-tensor+crc32", per_tensor_crc),
        ("flat-raw", flat_raw),
        ("flat", flat),
    ]
    for name, transport in links.items():
        for method, fn in methods:
            best: float | None = None
            for _ in range(args.repeat):
                if into is not None:
                    for t in into.values():
                        t.zero_()
                peer.barrier()
                took = fn(transport, rank, state)
                if took is not None:
                    best = took if best is None else min(best, took)
            equal = check_equal(peer, state, sent)
            if rank == 0 and best is not None:
                row = {
                    "transport": name,
                    "method": method,
                    "seconds": round(best, 4),
                    "mb_per_s": round(nbytes / MB / best, 1),
                    "bitwise_equal": equal,
                }
                rows.append(row)
                print(f"{name:<14} {method:<17} {best:>8.3f} {row['mb_per_s']:>7.0f}  {equal}", flush=True)
    peer.barrier()
    if rank == 0:
        for name in links:
            rate = {r["method"]: r["mb_per_s"] for r in rows if r["transport"] == name}
            print(
                f"{name}: flat-raw / per-tensor = {rate['flat-raw'] / rate['per-tensor']:.2f}x, "
                f"flat / per-tensor+crc32 = {rate['flat'] / rate['per-tensor+crc32']:.2f}x"
            )
        if args.json:
            result = {
                "tensors": len(state),
                "bytes": nbytes,
                "repeat": args.repeat,
                "chunk_bytes": CHUNK,
                "digest": "crc32",
                "torch": torch.__version__,
                "load_average_1min": {"start": load_at_start, "end": round(os.getloadavg()[0], 2)},
                "rows": rows,
            }
            _forget_role_arguments()
            manifest.write_result(args.json, result)
            print(f"wrote {args.json}")


def _forget_role_arguments() -> None:
    """Record the command a person typed: without the ``--port P --role R`` the launcher added."""
    argv = getattr(sys, "orig_argv", None)
    if argv and argv[-4:-3] == ["--port"] and argv[-2:-1] == ["--role"]:
        del argv[-4:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.tensors < 4:
        raise SystemExit("--tensors must be at least 4")
    if args.role is not None:
        run_rank(args, args.role)
        return 0
    port = str(free_port())
    module = "benchmarks.experiments.flat_vs_per_tensor"
    procs = [
        subprocess.Popen([sys.executable, "-m", module, *argv, "--port", port, "--role", str(rank)], cwd=ROOT)
        for rank in (0, 1)
    ]
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())
