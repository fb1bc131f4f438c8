"""The supervisor's own component: the site file, the precedence, the heterogeneous sbatch call.

The dry run of a heterogeneous job is checked against a golden file; regenerate with
``TP_UPDATE_GOLDEN=1 pytest tests/unit/submit/test_placement.py`` and review the diff.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.submit.test_cli import FakeSubmitter, Outcome, fake, tp_submit  # noqa: F401
from tests.unit.submit.test_render import check_golden
from torchpass_slurm.cli import submit as cli
from torchpass_slurm.errors import ConfigError
from torchpass_slurm.submit.placement import SupervisorPlacement, load_site_config, resolve_placement

SITE = """\
[supervisor]
partition = "service"
cpus = 1
mem_per_cpu = "512M"
"""


@pytest.fixture
def site(
    fake: FakeSubmitter,  # noqa: F811 (the fixture imported above)
    monkeypatch: pytest.MonkeyPatch,
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    path = tmp_path_factory.mktemp("etc") / "submit.toml"
    path.write_text(SITE)
    monkeypatch.setenv("TORCHPASS_SUBMIT_CONFIG", str(path))
    fake.partitions["service"] = 1
    return path


def test_dry_run_of_a_heterogeneous_job_golden(site: Path, fake: FakeSubmitter) -> None:  # noqa: F811
    result = tp_submit(
        "--dry-run", "--run-dir", "/shared/r", "--mail-type", "END", "--gres=gpu:4", "-A", "proj", "train.sh"
    )
    assert result.code == 0 and result.err == ""
    check_golden("dry_run_hetjob.txt", result.out)
    assert fake.submitted == [] and fake.asked == [None, "service"]


def test_the_heterogeneous_job_is_what_sbatch_gets(site: Path, fake: FakeSubmitter) -> None:  # noqa: F811
    assert tp_submit("--parsable", "--run-dir", "r", "-t", "5", "--", "true").code == 0
    ((script, args),) = fake.submitted
    colon = args.index(":")
    assert args[colon + 1 :] == ("--nodes=1", "--ntasks-per-node=1", "--no-kill")
    assert args[:colon][-8:] == (
        "--partition=service",
        "--nodes=1",
        "--ntasks=1",
        "--cpus-per-task=1",
        "--mem-per-cpu=512M",
        "--no-kill",
        "-t",
        "5",
    )
    assert "\nexport TORCHPASS_TRAINING_HET_GROUP=1\n" in script


def test_the_command_line_wins_and_none_means_the_node_of_rank_0(site: Path, fake: FakeSubmitter) -> None:  # noqa: F811
    fake.partitions["cpu"] = 3
    assert tp_submit("--parsable", "--supervisor-partition", "cpu", "--", "true").code == 0
    assert "--partition=cpu" in fake.submitted[-1][1]
    assert tp_submit("--parsable", "--supervisor-partition=none", "--", "true").code == 0
    assert ":" not in fake.submitted[-1][1]


def test_an_unknown_supervisor_partition_is_refused(site: Path, fake: FakeSubmitter) -> None:  # noqa: F811
    result = tp_submit("--supervisor-partition", "nosuch", "--", "true")
    assert result == Outcome(
        2,
        "",
        (
            "error: the supervisor partition 'nosuch' (from the command line) "
            "is not a partition Slurm knows\n"
            "  hint: check `sinfo -s`, or give --supervisor-partition none to run the supervisor on the "
            "node of rank 0\n"
        ),
    )
    assert fake.submitted == []


def test_without_a_partition_the_note_is_said_once(fake: FakeSubmitter) -> None:  # noqa: F811
    cli.note_marker().unlink()
    first = tp_submit("--parsable", "--", "true")
    second = tp_submit("--parsable", "--", "true")
    assert first == Outcome(0, "4242\n", cli.NOT_REPLACEABLE_NOTE + "\n")
    assert second == Outcome(0, "4242\n", "")
    assert all(":" not in args for _, args in fake.submitted)


def test_precedence_command_line_environment_file() -> None:
    table = {"partition": "svc", "cpus": 4, "mem_per_cpu": "2G"}
    env = {"TORCHPASS_SUPERVISOR_PARTITION": "envpart"}
    assert resolve_placement("cli", env, table, "f") == SupervisorPlacement(
        "cli", 4, "2G", "the command line"
    )
    assert resolve_placement(None, env, table, "f") == SupervisorPlacement(
        "envpart", 4, "2G", "TORCHPASS_SUPERVISOR_PARTITION"
    )
    assert resolve_placement(None, {}, table, "f") == SupervisorPlacement("svc", 4, "2G", "f")
    assert resolve_placement(None, {}, {}, "f") is None
    assert resolve_placement("none", env, table, "f") is None


def test_site_file_errors_name_what_is_valid(tmp_path: Path) -> None:
    path = tmp_path / "submit.toml"
    path.write_text('[supervisor]\npartition = "s"\nmemory = "1G"\n')
    with pytest.raises(
        ConfigError,
        match=r"unknown key\(s\) memory in \[supervisor\]; the valid ones "
        r"are partition, cpus, mem_per_cpu",
    ):
        load_site_config({"TORCHPASS_SUBMIT_CONFIG": str(path)})
    with pytest.raises(ConfigError, match="cpus must be a whole number from 1 to 64, got 0"):
        resolve_placement(None, {}, {"cpus": 0}, "f")
    with pytest.raises(ConfigError, match="mem_per_cpu must be a size"):
        resolve_placement(None, {}, {"mem_per_cpu": "lots"}, "f")
    assert load_site_config({"TORCHPASS_SUBMIT_CONFIG": str(tmp_path / "absent.toml")}) == (
        {},
        str(tmp_path / "absent.toml"),
    )
