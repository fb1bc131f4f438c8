"""Builders of facts, a simulated-devices file, a fake Slurm that rejects unknown calls,
and `tp` run through its real error boundary."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from click.testing import CliRunner

from torchpass_slurm.cli import health as health_cli
from torchpass_slurm.cli.app import run_cli
from torchpass_slurm.cli.main import cli
from torchpass_slurm.health.config import HealthConfig
from torchpass_slurm.health.facts import DiskFacts, Facts, GpuFacts, HostFacts
from torchpass_slurm.health.gpu_signals import Verdict
from torchpass_slurm.slurm import Node

NOW = 1_741_064_767.0
#: The GPU signal verdicts by short names, for the tables of the GPU tests.
MOVE, PLAN, APP, NONE, UNKNOWN = (
    Verdict.MOVE_NOW,
    Verdict.PLAN_MOVE,
    Verdict.APP_FAULT,
    Verdict.NONE,
    Verdict.UNKNOWN,
)


def gpu(index: int = 0, **changes: Any) -> GpuFacts:
    """A healthy GPU with every field reported."""
    healthy = GpuFacts(
        index=index,
        uuid=f"GPU-{index}",
        name="Sim H100",
        temperature_c=60.0,
        slowdown_c=88.0,
        shutdown_c=95.0,
        ecc_corrected=10,
        ecc_uncorrected=0,
        retired_pages=0,
        retired_pages_pending=False,
        remapped_rows_pending=False,
        remapped_rows_failure=False,
        xid_errors=(),
        throttle_reasons=(),
        pcie_gen=5,
        pcie_gen_max=5,
        pcie_width=16,
        pcie_width_max=16,
        nvlink_errors=(),
    )
    return replace(healthy, **changes)


def host(**changes: Any) -> HostFacts:
    healthy = HostFacts(
        memory_total_mb=100_000.0,
        memory_available_mb=50_000.0,
        disks=(DiskFacts("/var/spool/slurmd", free_mb=10_000.0, total_mb=20_000.0),),
    )
    return replace(healthy, **changes)


def facts(gpus: Iterable[GpuFacts] | None = (), **changes: Any) -> Facts:
    base = Facts(
        time=NOW, node="n1", source="simulated", gpus=None if gpus is None else tuple(gpus), host=host()
    )
    return replace(base, **changes)


def config(**changes: Any) -> HealthConfig:
    return HealthConfig(**changes)


class Outcome(NamedTuple):
    code: int
    out: str
    err: str


def tp(*argv: str) -> Outcome:
    """Run `tp ARGV...` as the console script does (`sys.exit(run_cli(...))`); capture everything.

    The health commands exit with their Nagios status through SystemExit (as `tp run` does).
    """
    with CliRunner().isolation() as (out, err, _):
        try:
            code = run_cli(cli, list(argv), prog_name="tp")
        except SystemExit as exit_:
            code = int(exit_.code or 0)
    return Outcome(code, out.getvalue().decode(), err.getvalue().decode())


def sim_gpu(index: int, **changes: Any) -> dict[str, Any]:
    """One GPU of a simulated-devices file, healthy unless changed."""
    doc = {
        "index": index,
        "uuid": f"GPU-{index}",
        "temperature_c": 60,
        "slowdown_c": 88,
        "shutdown_c": 95,
        "ecc_corrected": 10,
        "ecc_uncorrected": 0,
        "retired_pages": 0,
        "retired_pages_pending": False,
        "xid_errors": [],
        "throttle_reasons": [],
        "pcie_gen": 5,
        "pcie_gen_max": 5,
        "pcie_width": 16,
        "pcie_width_max": 16,
        "nvlink_errors": [],
    }
    doc.update(changes)
    return doc


@dataclass
class Sim:
    """A simulated node: its devices file, its config file, and the state file."""

    root: Path

    @property
    def devices(self) -> Path:
        return self.root / "devices.json"

    @property
    def config(self) -> Path:
        return self.root / "health.json"

    @property
    def state(self) -> Path:
        return self.root / "state.json"

    def write(self, doc: dict[str, Any]) -> None:
        self.devices.write_text(json.dumps(doc))

    def gpus(self, *gpus: dict[str, Any]) -> None:
        self.write({"gpus": list(gpus)})

    def configure(self, **settings: Any) -> None:
        base = {
            "expected_gpus": 2,
            "state_file": str(self.state),
            "disk_paths": [str(self.root)],
            "disk_free_warning_mb": 1,
            "disk_free_critical_mb": 1,
            "memory_available_warning_pct": 0,
            "memory_available_critical_pct": 0,
            "timeout_s": 5,
        }
        base.update(settings)
        self.config.write_text(json.dumps(base))


@pytest.fixture
def sim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Sim:
    """Two healthy simulated GPUs on node n1, a config that points at them."""
    node = Sim(tmp_path)
    node.gpus(sim_gpu(0), sim_gpu(1))
    node.configure()
    monkeypatch.setenv("TORCHPASS_HEALTH_SIMULATE", str(node.devices))
    monkeypatch.setenv("TORCHPASS_HEALTH_CONFIG", str(node.config))
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    monkeypatch.setenv("COLUMNS", "200")
    return node


@dataclass
class FakeSlurm:
    """A Slurm backend that knows nodes, drain and resume, and fails the test on anything else."""

    known: list[Node] = field(default_factory=list)
    calls: list[tuple[str, ...]] = field(default_factory=list)
    name: str = "fake"

    def nodes(self, names: Iterable[str] | None = None, *, partition: str | None = None) -> tuple[Node, ...]:
        self.calls.append(("nodes",))
        wanted = None if names is None else set(names)
        return tuple(n for n in self.known if wanted is None or n.name in wanted)

    def node(self, name: str) -> Node:
        self.calls.append(("node", name))
        return next(n for n in self.known if n.name == name)

    def drain(self, node: str, reason: str) -> None:
        self.calls.append(("drain", node, reason))

    def resume(self, node: str) -> None:
        self.calls.append(("resume", node))

    def __getattr__(self, name: str) -> Any:
        pytest.fail(f"FakeSlurm: unexpected Slurm call {name!r}")

    def changes(self) -> list[tuple[str, ...]]:
        """Only the calls that change Slurm's state."""
        return [c for c in self.calls if c[0] in ("drain", "resume")]


@pytest.fixture
def slurm(monkeypatch: pytest.MonkeyPatch) -> FakeSlurm:
    """The fake Slurm the health CLI talks to; node n1 is idle."""
    fake = FakeSlurm([Node("n1", "IDLE")])
    monkeypatch.setattr(health_cli, "slurm_backend", lambda timeout=None: fake)
    monkeypatch.setattr(health_cli, "clock", lambda: NOW)
    return fake
