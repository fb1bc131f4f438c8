"""The job's transport (TORCHPASS_TRANSPORT): tp-submit --transport, the environment, the site
file, the precedence between them, the batch script's export and the errors."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.unit.submit.test_cli import FakeSubmitter, fake, tp_submit  # noqa: F401
from tests.unit.submit.test_parse import NOW
from torchpass_slurm import config as cfg
from torchpass_slurm.cli.status import header_line
from torchpass_slurm.errors import ConfigError, SubmitError
from torchpass_slurm.rundir.status import JobStatus
from torchpass_slurm.submit import (
    parse_batch_script,
    parse_submit_args,
    render_batch_script,
    resolve_job_spec,
)
from torchpass_slurm.submit.placement import load_site_tables


def spec(argv: list[str], script: str | None = None, env: dict[str, str] | None = None, site: object = None):
    request = parse_submit_args(argv)
    parsed = parse_batch_script(script, request.script) if script is not None else None
    return resolve_job_spec(
        request,
        parsed,
        cwd="/home/u",
        now=NOW,
        environ=env or {},
        site_transport=site,
        site_path="/etc/s.toml",
    )  # type: ignore[arg-type]


def test_unset_everywhere_the_script_exports_nothing_and_the_ranks_use_auto() -> None:
    job = spec(["-N", "2", "--", "python", "t.py"])
    assert job.transport is None
    assert "TORCHPASS_TRANSPORT" not in render_batch_script(job)
    assert cfg.transport_from_env({}) == "auto"


def test_the_option_is_checked_and_exported_to_every_step() -> None:
    job = spec(["-N", "2", "--transport", "MPI", "--", "python", "t.py"])
    assert job.transport == "mpi"
    assert "export TORCHPASS_TRANSPORT=mpi\n" in render_batch_script(job)
    assert spec(["--transport=socket", "--", "x"]).transport == "socket"


def test_precedence_command_line_then_environment_then_site_file() -> None:
    env = {"TORCHPASS_TRANSPORT": "socket"}
    assert spec(["--transport", "mpi", "--", "x"], env=env, site="torch").transport == "mpi"
    assert spec(["--", "x"], env=env, site="torch").transport == "socket"
    assert spec(["--", "x"], site="torch").transport == "torch"
    assert spec(["--", "x"], env={"TORCHPASS_TRANSPORT": ""}, site="mpi").transport == "mpi"


def test_a_tp_line_sets_it_and_the_command_line_wins() -> None:
    script = "#!/bin/bash\n#TP --transport=mpi\ntp run python t.py\n"
    assert spec(["train.sh"], script).transport == "mpi"
    assert spec(["--transport", "torch", "train.sh"], script).transport == "torch"


def test_an_unknown_transport_is_refused_with_the_valid_ones() -> None:
    with pytest.raises(SubmitError, match=r"--transport='ucx' \(from the command line\): unknown") as info:
        spec(["--transport", "ucx", "--", "x"])
    assert info.value.hint is not None and "auto, socket, torch, mpi" in info.value.hint
    with pytest.raises(ConfigError, match=r"TORCHPASS_TRANSPORT='gloo': unknown transport"):
        spec(["--", "x"], env={"TORCHPASS_TRANSPORT": "gloo"})
    with pytest.raises(ConfigError, match=r"/etc/s.toml: \[transfer\] transport: unknown"):
        spec(["--", "x"], site="nccl")
    with pytest.raises(ConfigError, match=r"must be a string"):
        spec(["--", "x"], site=3)
    with pytest.raises(ConfigError, match=r"TORCHPASS_TRANSPORT='x'"):
        cfg.transport_from_env({"TORCHPASS_TRANSPORT": "x"})


def test_the_site_file_has_a_transfer_table(tmp_path: Path) -> None:
    path = tmp_path / "submit.toml"
    path.write_text('[transfer]\ntransport = "mpi"\n[supervisor]\ncpus = 2\n')
    tables, where = load_site_tables({"TORCHPASS_SUBMIT_CONFIG": str(path)})
    assert (tables["transfer"], tables["supervisor"], where) == ({"transport": "mpi"}, {"cpus": 2}, str(path))
    path.write_text('[transfer]\nkind = "mpi"\n')
    with pytest.raises(
        ConfigError, match=r"unknown key\(s\) kind in \[transfer\]; the valid ones are transport"
    ):
        load_site_tables({"TORCHPASS_SUBMIT_CONFIG": str(path)})
    path.write_text("[mpi]\n")
    with pytest.raises(ConfigError, match=r"the valid ones are \[supervisor\], \[transfer\]"):
        load_site_tables({"TORCHPASS_SUBMIT_CONFIG": str(path)})


def test_tp_submit_takes_the_site_default(
    fake: FakeSubmitter,  # noqa: F811 (the fixture imported above)
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    site = tmp_path / "submit.toml"
    site.write_text('[transfer]\ntransport = "mpi"\n')
    monkeypatch.setenv("TORCHPASS_SUBMIT_CONFIG", str(site))
    monkeypatch.delenv("TORCHPASS_TRANSPORT", raising=False)
    result = tp_submit("--dry-run", "-N", "1", "--", "python", "t.py")
    assert result.code == 0, result.err
    assert "export TORCHPASS_TRANSPORT=mpi\n" in result.out
    bad = tp_submit("--dry-run", "--transport", "tcp", "--", "python", "t.py")
    assert bad.code == 2 and "unknown transport 'tcp'" in bad.err


def test_tp_status_names_a_transport_other_than_auto() -> None:
    now = time.time()
    status = JobStatus(job_id="7", run_dir="/r", state="running", epoch=1, world_size=2, updated=now)
    assert "transport" not in header_line(status, now)
    mpi = JobStatus.from_json(JobStatus(**{**status.__dict__, "transport": "mpi"}).to_json())
    assert "restarts 0  transport mpi  status " in header_line(mpi, now)
