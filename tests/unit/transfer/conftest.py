"""Fixtures for the transfer contract tests: one receiver-side ``link`` per transport.

``link.start(scenario, **options)`` starts a donor process and returns
``(receiver transport, donor process)``. Socket, torch and mpi-process
(MPIProcessTransport: each end's MPI in a helper process of its own) donors fork
from a forkserver that preloaded torch (fast); in-process MPI donors (MPITransport,
what the benchmark's mpi rows use) start with ``mpiexec -n 1`` (MPICH singletons
cannot Connect to each other) and only when mpi4py imports here.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tests.unit.transfer import peers  # noqa: E402
from torchpass_slurm.transfer.mpi_transport import mpi_problem  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
KINDS = ["socket", "torch", "mpi", "mpi-process"]


def mpiexec() -> str | None:
    """mpiexec next to this Python (a venv with the mpich wheel), else on PATH."""
    return shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")


class Donor:
    """A donor process: a multiprocessing child or an mpiexec subprocess."""

    def __init__(self, proc: Any) -> None:
        self.proc = proc

    def kill(self) -> None:
        if isinstance(self.proc, subprocess.Popen):
            if self.proc.poll() is None:
                self.proc.kill()
        elif self.proc.is_alive():
            self.proc.kill()

    def join(self, timeout: float) -> int | None:
        if isinstance(self.proc, subprocess.Popen):
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                return None
        self.proc.join(timeout)
        return self.proc.exitcode


class Link:
    """The receiver's end of one transport kind; starts donors and hands out transports."""

    def __init__(self, kind: str, ctx: Any, store: Any, tmp: Path) -> None:
        self.kind, self.ctx, self.store, self.tmp = kind, ctx, store, tmp
        self.donors: list[Donor] = []
        self.transports: list[Any] = []

    def start(self, scenario: str, **options: Any) -> tuple[Any, Donor]:
        link, accept = self._prepare()
        arg = json.dumps({"link": link, "scenario": scenario, **options})
        if self.kind == "mpi":
            env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPIR_"))}
            env["PYTHONPATH"] = str(REPO)
            proc: Any = subprocess.Popen(
                [str(mpiexec()), "-n", "1", sys.executable, "-m", "tests.unit.transfer.peers", arg],
                cwd=REPO,
                env=env,
            )
        else:
            proc = self.ctx.Process(target=peers.donor_main, args=(arg,), daemon=True)
            proc.start()
        donor = Donor(proc)
        self.donors.append(donor)
        transport = accept()
        self.transports.append(transport)
        return transport, donor

    def _prepare(self) -> tuple[dict[str, Any], Any]:
        if self.kind == "socket":
            from torchpass_slurm.transfer import SocketListener

            listener = SocketListener("127.0.0.1", 0)

            def accept_socket() -> Any:
                with listener:
                    return listener.accept(peers.TIMEOUT)

            return {"kind": "socket", "port": listener.port}, accept_socket
        if self.kind == "torch":
            from torchpass_slurm.transfer import TorchTransport

            prefix = f"epoch-{uuid.uuid4().hex[:8]}"
            return (
                {"kind": "torch", "port": self.store.port, "prefix": prefix},
                lambda: TorchTransport(1, peers.gloo_pair(self.store, prefix, 0, peers.TIMEOUT)),
            )
        from torchpass_slurm.transfer import MPITransport
        from torchpass_slurm.transfer.mpi_process import MPIProcessTransport

        port_file = self.tmp / f"port-{uuid.uuid4().hex[:8]}"

        def publish(name: str) -> None:
            (port_file.with_suffix(".tmp")).write_text(name)
            os.replace(port_file.with_suffix(".tmp"), port_file)

        accept = MPIProcessTransport.accept if self.kind == "mpi-process" else MPITransport.accept
        return (
            {"kind": self.kind, "port_file": str(port_file)},
            lambda: accept(publish, peers.TIMEOUT),
        )

    def cleanup(self) -> None:
        for donor in self.donors:
            donor.kill()
            donor.join(5)
        for transport in self.transports:
            if self.kind == "mpi-process" or (transport.broken is None and self.kind != "mpi"):
                transport.close()  # an mpi-process transport's close always stops its helper


@functools.cache
def helper_problem() -> str | None:
    """Why an MPI helper cannot run here (no MPICH hydra, its MPI does not start), or None;
    found by starting one (about 0.2 s)."""
    from torchpass_slurm.errors import TransferError
    from torchpass_slurm.transfer.mpi_process import MPIProcessTransport

    try:
        MPIProcessTransport.accept(lambda port: None, timedelta(seconds=10), lambda: "probe done")
    except TransferError as exc:
        return None if "probe done" in str(exc) else str(exc).splitlines()[0]
    return "the probe's accept returned without a peer"


@pytest.fixture(scope="session")
def forkserver() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tests.unit.transfer.peers"])
    return ctx


@pytest.fixture(scope="session")
def store() -> Any:
    """The rendezvous store, hosted by the test process (as the supervisor hosts it)."""
    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )


@pytest.fixture(params=KINDS)
def link(request: pytest.FixtureRequest, forkserver: Any, store: Any) -> Iterator[Link]:
    kind = request.param
    if kind == "mpi":
        problem = mpi_problem()
        if problem is None and mpiexec() is None:
            problem = "mpiexec is not on PATH (MPI donors start with mpiexec -n 1)"
        if problem:
            pytest.skip(f"MPI transport not tested: {problem}")
    if kind == "mpi-process" and (problem := helper_problem()):
        pytest.skip(f"MPI helper not tested: {problem}")
    with tempfile.TemporaryDirectory() as tmp:
        link = Link(kind, forkserver, store, Path(tmp))
        try:
            yield link
        finally:
            link.cleanup()
