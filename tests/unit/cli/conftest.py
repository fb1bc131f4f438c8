"""A run folder with a known status.json and events.jsonl, a fixed clock, and
`tp` run through its real error boundary (full stdout, stderr and exit code)."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest
from click.testing import CliRunner

from tests.unit.slurm.conftest import FakeRunner, fixture_text
from torchpass_slurm.cli import status as status_cli
from torchpass_slurm.cli.app import run_cli
from torchpass_slurm.cli.main import cli
from torchpass_slurm.rundir.events import EventLog
from torchpass_slurm.rundir.status import JobStatus, NodeStatus, write_status
from torchpass_slurm.slurm.cli_backend import CliSlurm

#: The fixed "now" of every test: 2025-03-04 05:06:07 UTC.
NOW = 1741064767.0


class Outcome(NamedTuple):
    code: int
    out: str
    err: str


def tp(*argv: str) -> Outcome:
    """Run `tp ARGV...` as the console script does; capture everything."""
    with CliRunner().isolation() as (out, err, _):
        code = run_cli(cli, list(argv), prog_name="tp")
    return Outcome(code, out.getvalue().decode(), err.getvalue().decode())


def job_status(run_dir: Path, **changes: object) -> JobStatus:
    """A job of 2 active nodes (4 ranks each), one failed and one spare, 1 s old."""
    fields: dict[str, object] = dict(
        job_id="4242",
        run_dir=str(run_dir),
        state="running",
        epoch=2,
        world_size=8,
        updated=NOW - 1.0,
        restarts=0,
        message="spare s1 replaced n2",
        nodes=(
            NodeStatus("n1", "active", (0, 1, 2, 3), "running", 120, NOW - 0.4),
            NodeStatus("s1", "active", (4, 5, 6, 7), "running", 119, NOW - 6.0),
            NodeStatus("n2", "failed", (), "lost", 97, NOW - 75.0, 137),
            NodeStatus("s2", "spare", (), "standby", None, NOW - 25.0),
        ),
    )
    fields.update(changes)
    return JobStatus(**fields)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def fixed_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 100-column, colourless console and a stopped clock."""
    monkeypatch.setenv("COLUMNS", "100")
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(status_cli, "clock", lambda: NOW)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run folder as the supervisor leaves it mid-run."""
    folder = tmp_path / "runs" / "r1"
    folder.mkdir(parents=True)
    write_status(folder, job_status(folder))
    times = iter([NOW - 60.0, NOW - 30.5, NOW - 30.25, NOW - 30.0])
    with EventLog(folder / "events.jsonl", job="4242", epoch=1, clock=lambda: next(times)) as log:
        log.append("started", nodes=["n1", "n2", "s1", "s2"])
        log.append("heartbeat_lost", node="n2", silent_s=20.5)
        log.append("spare_promoted", epoch=2, node="s1", replaces="n2", reason="heartbeat lost")
        log.epoch = 2
        log.append("step_exited", node="n2", exit_code=137)
    return folder


def scontrol_job(comment: str | None = None, std_out: str | None = None) -> str:
    """Recorded `scontrol -o show job 1` text, with a comment and stdout of our choosing."""
    text = fixture_text("24.11", "scontrol_show_job_running.txt")
    if comment is not None:
        text = text.replace("WorkDir=/ ", f"WorkDir=/ Comment={comment} ")
    if std_out is not None:
        text = text.replace("StdOut=//slurm-1.out", f"StdOut={std_out}")
    return text


@pytest.fixture
def slurm_job(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Make job 1 known to a CliSlurm over a FakeRunner; returns the setter."""

    def use(text: str) -> FakeRunner:
        runner = FakeRunner().on(["scontrol", "-o", "show", "job", "1"], text)
        monkeypatch.setattr("torchpass_slurm.slurm.select_backend", lambda: CliSlurm(runner))
        return runner

    return use
