"""The donor side of the transfer contract tests, run in a separate process.

The receiver is the pytest process; each donor is a child process (forked from
a forkserver that preloaded torch, or ``mpiexec -n 1 python -m`` this module
for the in-process MPITransport, whose singletons cannot connect to each other;
an ``mpi-process`` donor is a forkserver child whose transport starts its own helper). A donor gets one JSON
argument: how to reach the receiver (``link``) and what to do (``scenario``):

- ``send``: send :func:`make_state` (options: chunk_bytes, corrupt_chunks);
- ``die``: like send, but SIGKILL itself before chunk ``k`` goes out;
- ``silent``: connect, then send nothing;
- ``raw``: send a hand-made header + manifest, exit 0 iff the receiver rejected it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from torchpass_slurm.rank.checkpoint import RNGState
from torchpass_slurm.transfer import stream
from torchpass_slurm.transfer.chunks import byte_view, pack_header, recv_ints
from torchpass_slurm.transfer.manifest import build_manifest
from torchpass_slurm.transfer.transport import Handle, Transport

TIMEOUT = timedelta(seconds=10)
CHUNK = 4096


# --- the state ---------------------------------------------------------------------------


def make_model_and_optimizer(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small MLP and AdamW after one step (so the optimizer has int-keyed state)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    loss = model(torch.randn(8, 64)).pow(2).mean()
    loss.backward()
    opt.step()
    return model, opt


def make_state(seed: int = 1) -> dict[str, Any]:
    """A real training state: model, optimizer, RNG states and python scalars."""
    torch.set_num_threads(1)
    random.seed(seed)
    np.random.seed(seed)
    model, opt = make_model_and_optimizer(seed)
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "rng": RNGState(rank=0).state_dict(),
        "step": 7,
        "loss": 0.123456789,
        "extra": (1, "two", None, float("inf"), [True, 2.5]),
    }


def assert_bitwise_equal(a: Any, b: Any, path: str = "") -> None:
    """Same types, same keys (types and order), tensors with the same bytes.

    Mappings compare as mappings: an OrderedDict (model.state_dict()) arrives as a dict.
    """
    if isinstance(a, dict) and isinstance(b, dict):
        a, b = dict(a), dict(b)
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        assert list(a) == list(b) and [type(k) for k in a] == [type(k) for k in b], f"{path}: keys differ"
        for key in a:
            assert_bitwise_equal(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise_equal(x, y, f"{path}/{i}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{path}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
        )
        assert torch.equal(byte_view(a.contiguous()), byte_view(b.contiguous())), f"{path}: bytes differ"
    elif isinstance(a, float):
        assert a.hex() == b.hex(), f"{path}: {a!r} != {b!r}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


# --- links: how a donor reaches the receiver -----------------------------------------------


def gloo_pair(store: Any, prefix: str, rank: int, timeout: timedelta) -> Any:
    """A two-rank gloo group over ``PrefixStore(prefix, store)`` on 127.0.0.1 (one per 'epoch')."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, 2, opts)


def connect(link: dict[str, Any]) -> Transport:
    """The donor's transport for ``link``."""
    if link["kind"] == "socket":
        from torchpass_slurm.transfer import SocketTransport

        return SocketTransport.connect("127.0.0.1", link["port"], TIMEOUT)
    if link["kind"] == "torch":
        from torchpass_slurm.transfer import TorchTransport

        store = dist.TCPStore("127.0.0.1", link["port"], is_master=False, timeout=TIMEOUT)
        return TorchTransport(0, gloo_pair(store, link["prefix"], 1, TIMEOUT))
    if link["kind"] in ("mpi", "mpi-process"):
        from torchpass_slurm.transfer import MPITransport
        from torchpass_slurm.transfer.mpi_process import MPIProcessTransport

        while not os.path.exists(link["port_file"]):
            time.sleep(0.02)
        with open(link["port_file"]) as f:
            port = f.read()
        if link["kind"] == "mpi-process":
            return MPIProcessTransport.connect(port, TIMEOUT)
        return MPITransport.connect(port, TIMEOUT)
    raise ValueError(f"unknown link {link}")


# --- scenarios -------------------------------------------------------------------------------


class DyingTransport(Transport):
    """Forwards to ``inner``; SIGKILLs ``victim()`` (this process) before chunk ``k``'s data is sent."""

    def __init__(self, inner: Transport, k: int, victim: Any = os.getpid) -> None:
        super().__init__()
        self.inner, self.k, self.isends, self.handles = inner, k, 0, []
        self.victim = victim

    def _send(self, buf: torch.Tensor, timeout: timedelta) -> None:
        self.inner.send(buf, timeout)

    def _recv(self, buf: torch.Tensor, timeout: timedelta) -> None:
        self.inner.recv(buf, timeout)

    def _isend(self, buf: torch.Tensor, timeout: timedelta) -> Handle:
        if self.isends == 2 * self.k:  # chunks go out as (data, digest) pairs
            for handle in self.handles:
                handle.wait(timeout)
            time.sleep(0.2)  # let the last bytes leave
            os.kill(self.victim(), signal.SIGKILL)
        self.isends += 1
        self.handles.append(self.inner.isend(buf, timeout))
        return self.handles[-1]

    def close(self) -> None:
        self.inner.close()


def raw_donor(transport: Transport, doc_patch: dict[str, Any], garbage: bool) -> int:
    """Send a doctored manifest; 0 iff the receiver answered 'rejected'."""
    manifest, _ = build_manifest(make_state(), chunk_bytes=CHUNK, digest_algo="crc32")
    doc = json.loads(manifest.to_json())
    doc.update(doc_patch)
    raw = b"{not json" if garbage else json.dumps(doc).encode()
    transport.send(pack_header(len(raw)), TIMEOUT)
    transport.send(torch.frombuffer(bytearray(raw), dtype=torch.uint8), TIMEOUT)
    return 0 if recv_ints(transport, 1, TIMEOUT) == [-1] else 3


def donor_main(arg: str) -> None:
    """Entry point of a donor process (``arg`` is JSON)."""
    spec = json.loads(arg)
    transport = connect(spec["link"])
    scenario = spec["scenario"]
    code = 0
    if scenario == "silent":
        time.sleep(60)
    elif scenario == "raw":
        code = raw_donor(transport, spec.get("patch", {}), spec.get("garbage", False))
    else:
        if scenario == "die":
            transport = DyingTransport(transport, spec["k"])
        stats = stream.send_state(
            transport,
            make_state(),
            timeout=TIMEOUT,
            chunk_bytes=CHUNK,
            corrupt_chunks=spec.get("corrupt", ()),
            meta={"step": 7},
        )
        code = 0 if stats.retries == len(spec.get("corrupt", ())) else 4
    transport.close()
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    donor_main(sys.argv[1])
