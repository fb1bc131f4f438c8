"""Which backend select_backend() picks: pyslurm only when its major.minor matches Slurm's."""

from __future__ import annotations

import sys
import types

import pytest

from torchpass_slurm.errors import ConfigError, SlurmError
from torchpass_slurm.slurm.backend import BACKEND_ENV, SlurmBackend, pyslurm_matches, select_backend
from torchpass_slurm.slurm.cli_backend import CliSlurm
from torchpass_slurm.slurm.models import SlurmVersion
from torchpass_slurm.slurm.pyslurm_backend import PyslurmSlurm

from .conftest import FakeRunner


class _Obj:
    def __init__(self, **kw: object) -> None:
        self.__dict__.update(kw)


def fake_pyslurm(version: str) -> types.ModuleType:
    """A stand-in for pyslurm with the attributes PyslurmSlurm reads."""
    mod = types.ModuleType("pyslurm")
    mod.__version__ = version  # type: ignore[attr-defined]
    node = _Obj(name="n2", state="MIXED+DRAIN", reason="tp: x", partitions=["debug"], total_cpus=2)
    mod.Nodes = _Obj(load=lambda: {"n2": node})  # type: ignore[attr-defined]
    job = _Obj(
        id=7,
        name="j",
        state="RUNNING",
        nodes="n[1-2]",
        batch_host="n1",
        partition="debug",
        state_reason="None",
        num_nodes=2,
    )
    mod.Job = _Obj(load=lambda job_id: job)  # type: ignore[attr-defined]
    return mod


@pytest.fixture
def runner_2411() -> FakeRunner:
    return FakeRunner().on(["sinfo", "--version"], "slurm-wlm 24.11.5\n")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)


def test_no_pyslurm_means_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyslurm", None)  # makes `import pyslurm` fail
    backend = select_backend(FakeRunner())
    assert isinstance(backend, CliSlurm) and backend.name == "cli"
    assert isinstance(backend, SlurmBackend)


def test_matching_pyslurm_is_used(monkeypatch: pytest.MonkeyPatch, runner_2411: FakeRunner) -> None:
    monkeypatch.setitem(sys.modules, "pyslurm", fake_pyslurm("24.11.0"))
    backend = select_backend(runner_2411)
    assert isinstance(backend, PyslurmSlurm) and backend.name == "pyslurm"
    (node,) = backend.nodes()
    assert (node.name, node.state_text, node.is_draining) == ("n2", "MIXED+DRAIN", True)
    job = backend.job(7)
    assert (job.nodes, job.reason, job.batch_host) == (("n1", "n2"), None, "n1")


def test_mismatched_pyslurm_falls_back(monkeypatch: pytest.MonkeyPatch, runner_2411: FakeRunner) -> None:
    monkeypatch.setitem(sys.modules, "pyslurm", fake_pyslurm("25.11.1"))
    backend = select_backend(runner_2411)
    assert type(backend) is CliSlurm


def test_forced_pyslurm_fails_loudly(monkeypatch: pytest.MonkeyPatch, runner_2411: FakeRunner) -> None:
    monkeypatch.setitem(sys.modules, "pyslurm", fake_pyslurm("25.11.1"))
    monkeypatch.setenv(BACKEND_ENV, "pyslurm")
    with pytest.raises(SlurmError) as info:
        select_backend(runner_2411)
    assert info.value.message == (
        "TORCHPASS_SLURM_BACKEND=pyslurm was asked for, but pyslurm 25.11.1 does not match Slurm 24.11.5"
    )


def test_forced_cli_never_imports_pyslurm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyslurm", fake_pyslurm("24.11.0"))
    backend = select_backend(FakeRunner(), choice="cli")  # FakeRunner would fail on sinfo --version
    assert type(backend) is CliSlurm


def test_unknown_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "slurmrestd")
    with pytest.raises(ConfigError) as info:
        select_backend(FakeRunner())
    assert info.value.hint == "valid values: auto, cli, pyslurm."


@pytest.mark.parametrize(
    ("version", "ok"),
    [("24.11.0", True), ("24.11", True), ("24.05.3", False), ("25.11.0", False), ("", False), ("x.y", False)],
)
def test_pyslurm_matches(version: str, ok: bool) -> None:
    mod = types.ModuleType("pyslurm")
    mod.__version__ = version  # type: ignore[attr-defined]
    assert pyslurm_matches(mod, SlurmVersion(24, 11, 5)) is ok
