"""Helpers of the tests that run real gloo ranks on loopback: a control client that only
records, a free port, a rendezvous store on 127.0.0.1 (torch's, or the job's own store that
tp run hosts), and a rank's place in a group that meets there."""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from torchpass_slurm.rank.runtime import RankInfo, make_tcp_store


class FakeClient:
    """A control client that records what the rank sends and never receives anything."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def send(self, kind: str, body: dict[str, Any]) -> None:
        self.sent.append((kind, body))

    def recv(self, timeout: datetime.timedelta) -> None:
        return None

    def close(self) -> None:
        pass

    def reports(self) -> list[tuple[str, dict[str, Any]]]:
        """(event, fields) of every report sent."""
        return [(b["event"], b["fields"]) for k, b in self.sent if k == "report"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def info(rank: int, world: int, port: int, epoch: int = 0) -> RankInfo:
    return RankInfo(
        rank=rank,
        world_size=world,
        local_rank=0,
        local_world_size=1,
        master_addr=None,
        master_port=None,
        epoch=epoch,
        store_addr="127.0.0.1",
        store_port=port,
    )


@contextlib.contextmanager
def loopback_store() -> Iterator[int]:
    """A rendezvous store on 127.0.0.1, as tp run hosts one; its port. Leaves no process group."""
    import torch.distributed as dist

    port = free_port()
    keep = make_tcp_store("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=30))
    try:
        yield port
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        del keep


@contextlib.contextmanager
def job_store(secret: bytes) -> Iterator[Any]:
    """The job's store (``control/store_server.py``) on 127.0.0.1 for ``secret``, served by a
    thread of the test, as tp run's store process serves it; the server (``.port``)."""
    from torchpass_slurm.control.store_server import StoreServer

    server = StoreServer(secret, "127.0.0.1")
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), name="test-job-store", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        stop.set()
        thread.join(5)
        server.close()


def run_script_ranks(
    argv: Sequence[str], world: int, *, env: Mapping[str, str] | None = None, expect: int = 0
) -> str:
    """Run ``python argv...`` as ``world`` ranks the way torchrun would (RANK, WORLD_SIZE,
    MASTER_ADDR on 127.0.0.1, no Slurm, no tp run), each expected to exit ``expect``; rank
    0's stdout. ``env`` is added to every rank's environment."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        rank_env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHPASS_", "SLURM_"))}
        rank_env.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            USE_LIBUV="0",
            PYTHONWARNINGS="ignore",
            **(env or {}),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, *argv],
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:  # a rank left hanging (its peer failed) must not outlive the test
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == expect, err[-3000:]
    return outputs[0][0]
