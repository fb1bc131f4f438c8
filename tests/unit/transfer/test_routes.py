"""The route of a transfer (``rank/routes.py``) between real processes: over MPITransport
(each end under its own ``mpiexec -n 1``, as two ``srun --mpi=pmi2`` steps), the fallback to
the group when MPI is missing, and a donor killed mid-transfer over MPI whose receiver resumes
from another donor. The state arrives bitwise equal every time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tests.unit.transfer.conftest import REPO, mpiexec  # noqa: E402
from tests.unit.transfer.route_peers import make_state  # noqa: E402
from torchpass_slurm.transfer.mpi_transport import mpi_problem  # noqa: E402


def start(job: dict[str, Any], *, mpi: bool) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPIR_"))}
    env["PYTHONPATH"] = str(REPO)
    env["USE_LIBUV"] = "0"
    argv = [sys.executable, "-m", "tests.unit.transfer.route_peers", json.dumps(job)]
    return subprocess.Popen([str(mpiexec()), "-n", "1", *argv] if mpi else argv, cwd=REPO, env=env)


def finish(procs: list[subprocess.Popen[bytes]], timeout: float = 90) -> list[int]:
    return [p.wait(timeout) for p in procs]


def received(out: Path) -> dict[str, Any]:
    got = torch.load(str(out) + ".pt")
    want = make_state()
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"]) and got["step"] == 3
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def needs_mpi() -> None:
    problem = mpi_problem() or (None if mpiexec() else "mpiexec is not on PATH")
    if problem:
        pytest.skip(f"MPI routes not tested: {problem}")


def test_a_transfer_over_mpi_arrives_bitwise_equal_via_mpi(store: Any, tmp_path: Path) -> None:
    needs_mpi()
    out = tmp_path / "recv.json"
    procs = [
        start(
            {"role": "donor", "rank": 3, "store": store.port, "kind": "mpi", "out": str(tmp_path / "d3")},
            mpi=True,
        ),
        start(
            {"role": "receiver", "donors": [3], "store": store.port, "kind": "mpi", "out": str(out)}, mpi=True
        ),
    ]
    assert finish(procs) == [0, 0]
    assert received(out) == {"via": "mpi", "resumed_from": 0, "donor": 3, "failed": []}
    assert json.loads((tmp_path / "d3").read_text())["via"] == "mpi"


@pytest.mark.parametrize("kind", ["mpi", "socket"])
def test_a_route_that_cannot_open_falls_back_to_the_group(store: Any, tmp_path: Path, kind: str) -> None:
    out = tmp_path / "recv.json"
    rank = 4 if kind == "mpi" else 14  # one store for the session: a key of its own per test
    donor = {"role": "donor", "rank": rank, "store": store.port, "kind": kind, "out": str(tmp_path / "d")}
    receiver = {"role": "receiver", "donors": [rank], "store": store.port, "kind": kind, "out": str(out)}
    if kind == "mpi":
        donor["no_mpi"] = True  # the donor publishes {"kind": "none"}; the receiver falls back at once
    else:
        receiver["no_mpi"] = donor["no_mpi"] = True  # a socket route does not need MPI
    procs = [start(donor, mpi=False), start({**receiver, "gloo": True}, mpi=False)]
    assert finish(procs) == [0, 0]
    assert received(out)["via"] == ("group" if kind == "mpi" else "socket")
    assert json.loads((tmp_path / "d").read_text())["via"] == ("group" if kind == "mpi" else "socket")


def test_a_donor_killed_mid_transfer_over_mpi_is_resumed_from_another_donor(
    store: Any, tmp_path: Path
) -> None:
    needs_mpi()
    out = tmp_path / "recv.json"
    common = {"store": store.port, "kind": "mpi"}
    procs = [
        start({"role": "donor", "rank": 5, "die_at": 2, "out": str(tmp_path / "d5"), **common}, mpi=True),
        start({"role": "receiver", "donors": [5, 6], "stall": 3, "out": str(out), **common}, mpi=True),
    ]
    assert procs[0].wait(60) != 0  # killed itself before chunk 2
    second = start({"role": "donor", "rank": 6, "out": str(tmp_path / "d6"), **common}, mpi=True)
    assert finish([procs[1], second]) == [0, 0]
    result = received(out)
    assert (result["via"], result["donor"]) == ("mpi", 6)
    assert result["resumed_from"] == 2  # chunks 0 and 1 came from the dead donor
    assert len(result["failed"]) == 1 and "gone" in result["failed"][0]
