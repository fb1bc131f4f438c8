"""The route of a transfer (``rank/routes.py``) between real processes: plain processes, as
ranks are, each end's MPI in a helper process of its own (MPIProcessTransport). Over MPI
bitwise; MPI missing on the donor or unable to start on the receiver falls back to the group
with the reason written in the store (and the donor stops waiting at once); a donor whose
helper is killed mid-stream falls back and the receiver resumes from the verified chunks; a
donor killed mid-transfer is resumed from another donor. The state arrives bitwise equal every
time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tests.unit.transfer.conftest import REPO, helper_problem  # noqa: E402
from tests.unit.transfer.route_peers import make_state  # noqa: E402
from torchpass_slurm.rank import routes  # noqa: E402


def start(job: dict[str, Any]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "USE_LIBUV": "0"}
    argv = [sys.executable, "-m", "tests.unit.transfer.route_peers", json.dumps(job)]
    return subprocess.Popen(argv, cwd=REPO, env=env)


def finish(procs: list[subprocess.Popen[bytes]], timeout: float = 90) -> list[int]:
    return [p.wait(timeout) for p in procs]


def received(out: Path) -> dict[str, Any]:
    got = torch.load(str(out) + ".pt")
    want = make_state()
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"]) and got["step"] == 3
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def published(store: Any, donor: int, suffix: str = "") -> str:
    """What the store holds at the route's key of ``donor`` (+ ``suffix``)."""
    import torch.distributed as dist

    key = routes.ROUTE_KEY.format(donor=donor, receiver=9) + suffix
    return str(dist.PrefixStore("epoch2", store).get(key).decode())


def needs_mpi() -> None:
    if problem := helper_problem():
        pytest.skip(f"MPI routes not tested: {problem}")


def pair(store: Any, tmp_path: Path, rank: int, donor: dict[str, Any], receiver: dict[str, Any]) -> list[int]:
    """Run a donor ``rank`` and the receiver 9 with these options; their exit codes."""
    common = {"store": store.port, "kind": "mpi", "gloo": True}
    procs = [
        start({"role": "donor", "rank": rank, "out": str(tmp_path / "donor"), **common, **donor}),
        start({"role": "receiver", "donors": [rank], "out": str(tmp_path / "recv"), **common, **receiver}),
    ]
    return finish(procs)


def test_a_transfer_over_mpi_arrives_bitwise_equal_via_mpi(store: Any, tmp_path: Path) -> None:
    needs_mpi()
    assert pair(store, tmp_path, 3, {}, {}) == [0, 0]
    assert received(tmp_path / "recv") | {"seconds": 0} == {
        "via": "mpi",
        "resumed_from": 0,
        "donor": 3,
        "failed": [],
        "seconds": 0,
    }
    assert json.loads((tmp_path / "donor").read_text())["via"] == "mpi"


def test_a_socket_route_needs_no_mpi(store: Any, tmp_path: Path) -> None:
    assert pair(store, tmp_path, 14, {"kind": "socket"}, {"kind": "socket"}) == [0, 0]
    assert received(tmp_path / "recv")["via"] == "socket"
    assert json.loads((tmp_path / "donor").read_text())["via"] == "socket"


def test_mpi_missing_on_the_donor_sends_over_the_group_and_says_why(store: Any, tmp_path: Path) -> None:
    assert pair(store, tmp_path, 4, {"hydra": "/nonexistent/mpiexec.hydra"}, {}) == [0, 0]
    doc = json.loads(published(store, 4))
    assert doc["kind"] == "none"
    assert "cannot start the MPI helper with /nonexistent/mpiexec.hydra" in doc["why"]
    result = received(tmp_path / "recv")
    assert result["via"] == "group" and result["seconds"] < 20  # not after ROUTE_CONNECT_TIMEOUT
    assert json.loads((tmp_path / "donor").read_text())["via"] == "group"


def test_a_receiver_whose_mpi_cannot_start_refuses_and_the_donor_stops_waiting(
    store: Any, tmp_path: Path
) -> None:
    needs_mpi()
    assert pair(store, tmp_path, 7, {}, {"libmpi": "/nonexistent/libmpi.so.12"}) == [0, 0]
    assert "cannot init MPI: RuntimeError: cannot load MPI library" in published(store, 7, "/refused")
    assert received(tmp_path / "recv")["via"] == "group"
    donor = json.loads((tmp_path / "donor").read_text())
    assert donor["via"] == "group" and donor["seconds"] < 20  # it did not wait out the 30 s


def test_a_donor_whose_helper_dies_mid_stream_falls_back_and_the_receiver_resumes(
    store: Any, tmp_path: Path
) -> None:
    needs_mpi()
    assert pair(store, tmp_path, 8, {"kill_helper_at": 2}, {"stall": 3}) == [0, 0]
    result = received(tmp_path / "recv")
    assert (result["via"], result["resumed_from"], result["failed"]) == ("group", 2, [])
    donor = json.loads((tmp_path / "donor").read_text())
    assert (donor["via"], donor["resumed_from"]) == ("group", 2)


def test_a_donor_killed_mid_transfer_over_mpi_is_resumed_from_another_donor(
    store: Any, tmp_path: Path
) -> None:
    needs_mpi()
    out = tmp_path / "recv.json"
    common = {"store": store.port, "kind": "mpi"}
    procs = [
        start({"role": "donor", "rank": 5, "die_at": 2, "out": str(tmp_path / "d5"), **common}),
        start({"role": "receiver", "donors": [5, 6], "stall": 3, "out": str(out), **common}),
    ]
    assert procs[0].wait(60) != 0  # killed itself before chunk 2
    second = start({"role": "donor", "rank": 6, "out": str(tmp_path / "d6"), **common})
    assert finish([procs[1], second]) == [0, 0]
    result = received(out)
    assert (result["via"], result["donor"]) == ("mpi", 6)
    assert result["resumed_from"] == 2  # chunks 0 and 1 came from the dead donor
    assert len(result["failed"]) == 1 and "gone" in result["failed"][0]
