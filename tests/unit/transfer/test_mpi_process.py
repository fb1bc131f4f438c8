"""MPIProcessTransport: the launch, the helper's failures, and that it never leaves a process.

The pure parts (launch line, environment, wire headers) and the hostile helpers (a fake hydra
running a fake helper, fake_helper.py) need no MPI. The rest starts real helpers under MPICH's
hydra, both ends in this process (each end's MPI is in its own helper), and is skipped with
the reason where MPICH or mpi4py is missing.
"""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tests.unit.transfer.conftest import helper_problem  # noqa: E402
from torchpass_slurm.errors import TransferError, TransferTimeout  # noqa: E402
from torchpass_slurm.transfer import mpi_helper as wire  # noqa: E402
from torchpass_slurm.transfer import mpi_process  # noqa: E402
from torchpass_slurm.transfer.mpi_helper import Code  # noqa: E402
from torchpass_slurm.transfer.mpi_process import HelperLaunch, MPIProcessTransport, helper_env  # noqa: E402

T = timedelta(seconds=20)
FAKE = Path(__file__).with_name("fake_helper.py")


def gone(pid: int) -> bool:
    """No such process, or only its zombie (an orphan whose reaper is slow)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pids: list[int], within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while not all(gone(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# --- the launch, the environment, the wire (pure) --------------------------------------------


def test_the_launch_keeps_hydra_on_this_node_and_runs_the_helper_by_path() -> None:
    launch = HelperLaunch("/opt/mpich/bin/mpiexec.hydra", python="/venv/bin/python", host="node7")
    assert launch.argv(9) == [
        "/opt/mpich/bin/mpiexec.hydra",
        *("-launcher", "fork", "-rmk", "user", "-hosts", "node7", "-n", "1"),
        *("/venv/bin/python", str(Path(mpi_process.__file__).with_name("mpi_helper.py")), "9"),
    ]


def test_the_helper_loads_the_mpich_of_its_hydra(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    hydra = tmp_path / "bin" / "mpiexec.hydra"
    hydra.touch()
    assert HelperLaunch(str(hydra)).libmpi() is None  # no library there: found by its soname
    (tmp_path / "lib" / "libmpi.so.12").touch()
    assert HelperLaunch(str(hydra)).libmpi() == str(tmp_path / "lib" / "libmpi.so.12")


def test_the_helper_env_drops_the_steps_pmi_and_the_jobs_mpi4py_choice() -> None:
    job = {
        "PATH": "/bin",
        "SLURM_JOB_ID": "7",
        "PMI_FD": "5",
        "PMI_RANK": "3",
        "PMIX_NAMESPACE": "slurm.pmix.7.0",
        "HYDI_CONTROL_FD": "7",
        "MPIR_CVAR_CH4_NETMOD": "ofi",
        "HYDRA_IFACE": "ib0",
        "MPI4PY_MPIABI": "openmpi",
        "MPI4PY_LIBMPI": "/usr/lib/x86_64-linux-gnu/libmpi.so.40",
    }
    kept = {"PATH": "/bin", "SLURM_JOB_ID": "7", "MPIR_CVAR_CH4_NETMOD": "ofi", "HYDRA_IFACE": "ib0"}
    assert helper_env(job, "/mpich/lib/libmpi.so.12") == {**kept, "MPI4PY_LIBMPI": "/mpich/lib/libmpi.so.12"}
    assert helper_env(job, None) == {**kept, "MPI4PY_MPIABI": "mpich"}


@pytest.mark.parametrize(
    "raw, expected, message",
    [
        (b"XXXX" + wire.pack(Code.SENT, 4)[4:], wire.FROM_HELPER, "not a helper header"),
        (wire.HEADER.pack(wire.MAGIC, 2, Code.SENT, 4), wire.FROM_HELPER, "version 2"),
        (wire.pack(Code.SEND, 4), wire.FROM_HELPER, "unexpected message code 3"),
        (wire.pack(Code.SENT, 4), wire.FROM_RANK, "unexpected message code 20"),
        (wire.pack(Code.HELLO, 9), wire.FROM_HELPER, "HELLO with an argument of 9"),
        (wire.pack(Code.PORT, wire.MAX_TEXT + 1), wire.FROM_HELPER, "above its limit of 4096"),
        (wire.pack(Code.RECV, wire.MAX_MESSAGE + 1), wire.FROM_RANK, "above its limit"),
    ],
    ids=["magic", "version", "code-to-rank", "code-to-helper", "hello", "text", "message"],
)
def test_a_malformed_header_is_refused_with_what_is_wrong(
    raw: bytes, expected: frozenset[Code], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        wire.unpack(raw, expected)


# --- hostile or broken helpers (no MPI needed) -------------------------------------------------


@pytest.fixture
def fake_launch(tmp_path: Path) -> HelperLaunch:
    hydra = tmp_path / "mpiexec.hydra"
    hydra.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" hydra "$@"\n')
    hydra.chmod(0o755)
    return HelperLaunch(str(hydra), script=str(FAKE))


@pytest.mark.parametrize(
    "scenario, message",
    [
        ("exit-early", r"start the helper: the helper exited \(mpiexec exit status 7; .*last words"),
        ("bad-pid", "the helper said its pid is 1"),
        ("bad-magic", "connect: a malformed message: not a helper header"),
        ("error", "the MPI helper failed: cannot init MPI: RuntimeError: the test said so"),
        ("short-data", "recv: expected DATA of 4096 bytes, got DATA [(]4095[)]"),
    ],
)
def test_a_broken_helper_is_a_clear_transfer_error_and_leaves_no_process(
    fake_launch: HelperLaunch, monkeypatch: pytest.MonkeyPatch, scenario: str, message: str
) -> None:
    monkeypatch.setenv("TP_FAKE_HELPER", scenario)
    spawned = _spawned(monkeypatch)
    with pytest.raises(TransferError, match=message):
        transport = MPIProcessTransport.connect("fake-port", T, launch=fake_launch)
        transport.recv(torch.empty(4096, dtype=torch.uint8), T)
    assert spawned and all(p.returncode is not None for p in spawned)  # mpiexec reaped


def test_a_port_name_out_of_bounds_is_refused_when_accepting(
    fake_launch: HelperLaunch, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TP_FAKE_HELPER", "huge-port")
    with pytest.raises(TransferError, match="PORT with an argument of 4097, above its limit"):
        MPIProcessTransport.accept(lambda port: None, T, launch=fake_launch)


def test_a_missing_hydra_is_a_transfer_error_that_names_it() -> None:
    with pytest.raises(TransferError, match=r"cannot start the MPI helper with /nonexistent/mpiexec\.hydra"):
        MPIProcessTransport.connect("port", T, launch=HelperLaunch("/nonexistent/mpiexec.hydra"))


def test_a_helper_that_does_not_answer_times_out_and_is_stopped(
    fake_launch: HelperLaunch, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TP_FAKE_HELPER", "hang")
    transport = MPIProcessTransport.connect("fake-port", T, launch=fake_launch)
    pid = transport.helper_pid
    assert pid is not None and not gone(pid)
    began = time.monotonic()
    with pytest.raises(TransferTimeout, match=r"recv of 8 bytes did not complete within 0\.3 s"):
        transport.recv(torch.empty(8, dtype=torch.uint8), timedelta(seconds=0.3))
    assert time.monotonic() - began < 3
    assert wait_gone([pid], 1.0)
    with pytest.raises(TransferError, match="broken transport"):
        transport.recv(torch.empty(8, dtype=torch.uint8), T)
    transport.close()


def _spawned(monkeypatch: pytest.MonkeyPatch) -> list[subprocess.Popen[bytes]]:
    """Every mpiexec the transport starts, recorded."""
    spawned: list[subprocess.Popen[bytes]] = []
    real = subprocess.Popen

    def popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        spawned.append(real(*args, **kwargs))
        return spawned[-1]

    monkeypatch.setattr(mpi_process.subprocess, "Popen", popen)
    return spawned


# --- real helpers ------------------------------------------------------------------------------


@pytest.fixture
def mpi() -> None:
    if problem := helper_problem():
        pytest.skip(f"MPI helper not tested: {problem}")


def make_pair(**accept: Any) -> tuple[MPIProcessTransport, MPIProcessTransport]:
    """(accepting end, connecting end), both in this process."""
    box: dict[str, Any] = {}
    published = threading.Event()

    def publish(port: str) -> None:
        box["port"] = port
        published.set()

    def run() -> None:
        try:
            box["acceptor"] = MPIProcessTransport.accept(publish, T, **accept)
        except TransferError as exc:
            box["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    assert published.wait(20), box.get("error")
    connector = MPIProcessTransport.connect(box["port"], T)
    thread.join(20)
    return box["acceptor"], connector


@pytest.fixture
def pair(mpi: None) -> Iterator[tuple[MPIProcessTransport, MPIProcessTransport]]:
    ends = make_pair()
    yield ends
    for end in ends:
        end.close()


def test_operations_complete_in_order_whichever_handle_is_waited_first(
    pair: tuple[MPIProcessTransport, MPIProcessTransport],
) -> None:
    left, right = pair
    sizes = [5, 1 << 20, 0, 3 << 20]
    sent = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes]
    into = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    sends = [left.isend(buf, T) for buf in sent]
    recvs = [right.irecv(buf, T) for buf in into]
    reply = torch.tensor([7, 8, 9], dtype=torch.uint8)
    back = right.isend(reply, T)  # the other way round, posted behind the receives
    got = torch.empty(3, dtype=torch.uint8)
    left.recv(got, T)
    for handle in [*reversed(recvs), back, *sends]:
        handle.wait(T)
    assert all(torch.equal(a, b) for a, b in zip(sent, into, strict=True)) and torch.equal(got, reply)


def test_a_killed_local_helper_fails_the_wait_at_once_not_by_the_timeout(
    pair: tuple[MPIProcessTransport, MPIProcessTransport],
) -> None:
    _, right = pair
    handle = right.irecv(torch.empty(1 << 20, dtype=torch.uint8), T)
    pid = right.helper_pid
    assert pid is not None
    began = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(TransferError, match="recv: the helper exited") as failure:
        handle.wait(timedelta(seconds=15))
    assert time.monotonic() - began < 5 and not isinstance(failure.value, TransferTimeout)


def test_close_leaves_no_process(mpi: None, monkeypatch: pytest.MonkeyPatch) -> None:
    spawned = _spawned(monkeypatch)
    left, right = make_pair()
    helpers = [left.helper_pid, right.helper_pid]
    assert len(spawned) == 2 and None not in helpers
    left.close()
    right.close()
    assert all(p.returncode is not None for p in spawned)  # mpiexec reaped
    assert wait_gone([p for p in helpers if p is not None], 1.0)


def test_an_accept_given_up_stops_its_helper(mpi: None) -> None:
    began = time.monotonic()
    with pytest.raises(TransferError, match="accept given up: the receiver refused"):
        MPIProcessTransport.accept(lambda port: None, T, lambda: "the receiver refused")
    assert time.monotonic() - began < 5
    with pytest.raises(TransferTimeout, match=r"accept of 0 bytes did not complete within 1 s"):
        MPIProcessTransport.accept(lambda port: None, timedelta(seconds=1))


def test_a_helper_whose_mpi_cannot_start_says_so(mpi: None) -> None:
    class NoLibrary(HelperLaunch):
        def libmpi(self) -> str:
            return "/nonexistent/libmpi.so.12"

    launch = NoLibrary(HelperLaunch.find().hydra)
    with pytest.raises(TransferError, match="cannot init MPI: RuntimeError: cannot load MPI library"):
        MPIProcessTransport.connect("port", T, launch=launch)


def test_under_a_slurm_step_hydra_still_forks_here_and_never_calls_srun(
    mpi: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = tmp_path / "calls"
    for tool in ("srun", "scontrol", "sinfo"):
        fake = tmp_path / tool
        fake.write_text(f'#!/bin/sh\necho "{tool} $*" >> "{calls}"\nexit 1\n')
        fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    step = {"SLURM_JOB_ID": "77", "SLURM_JOBID": "77", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2"}
    step |= {"SLURM_NODELIST": "n[1-2]", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2"}
    step |= {"PMI_FD": "99", "PMI_RANK": "1", "PMI_SIZE": "2", "PMIX_RANK": "1"}
    for name, value in step.items():
        monkeypatch.setenv(name, value)
    left, right = make_pair()
    got = torch.empty(3, dtype=torch.uint8)
    handle = left.isend(torch.tensor([1, 2, 3], dtype=torch.uint8), T)
    right.recv(got, T)
    handle.wait(T)
    left.close()
    right.close()
    assert got.tolist() == [1, 2, 3] and not calls.exists()


def test_a_rank_that_dies_takes_its_helpers_with_it(mpi: None) -> None:
    code = (
        "import sys, time, torch\n"
        "from tests.unit.transfer.test_mpi_process import make_pair\n"
        "ends = make_pair()\n"
        "print(*(e.helper_pid for e in ends), flush=True)\n"
        "time.sleep(60)\n"
    )
    repo = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    rank = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=repo, env=env)
    try:
        assert rank.stdout is not None
        helpers = [int(p) for p in rank.stdout.readline().split()]
        assert len(helpers) == 2 and not any(gone(p) for p in helpers)
    finally:
        rank.kill()
        rank.wait(10)
    assert wait_gone(helpers, 5.0)  # each saw the EOF of its rank's socket and exited


def test_the_helper_refuses_a_malformed_command_and_says_why(
    pair: tuple[MPIProcessTransport, MPIProcessTransport],
) -> None:
    left, _ = pair
    left._helper.sock.sendall(b"GARBAGE!" * 2)  # a header that is not one, from "the rank"
    message = r"the helper exited .*malformed command from the rank: not a helper header"
    with pytest.raises(TransferError, match=message):
        left.recv(torch.empty(8, dtype=torch.uint8), T)


def test_the_helper_imports_only_the_standard_library_and_mpi4py() -> None:
    """It runs by path in a process of its own: never torch, never this package."""
    tree = ast.parse(Path(wire.__file__).read_text())
    names = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert {name.split(".")[0] for name in names} - set(sys.stdlib_module_names) == {"mpi4py"}
