"""`tp nodes` and `tp hostlist` end to end through the `tp` group, with a fake backend."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from torchpass_slurm.cli import nodes as nodes_module
from torchpass_slurm.cli.app import run_cli
from torchpass_slurm.cli.main import cli
from torchpass_slurm.errors import SlurmNotFoundError
from torchpass_slurm.slurm.cli_backend import CliSlurm

from .conftest import FakeRunner, fixture_text


@pytest.fixture
def use_fixture(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Make `tp nodes` read a recorded `sinfo --json` through a FakeRunner."""

    def use(version: str, name: str) -> FakeRunner:
        runner = FakeRunner().on(["sinfo", "--json"], fixture_text(version, name))
        monkeypatch.setattr(nodes_module, "select_backend", lambda: CliSlurm(runner))
        return runner

    monkeypatch.setenv("COLUMNS", "100")
    return use


TABLE = (
    " NODE   STATE   FLAGS   REASON                    PARTITIONS \n"
    "─────────────────────────────────────────────────────────────\n"
    " n2     MIXED   DRAIN   tp: planned maintenance   debug      \n"
    " n1     MIXED                                     debug      \n"
)


def test_nodes_table(use_fixture) -> None:  # type: ignore[no-untyped-def]
    use_fixture("24.11", "sinfo_mixed_drain.json")
    result = CliRunner().invoke(cli, ["nodes"])
    assert result.exit_code == 0, result.output
    assert result.output == TABLE


def test_nodes_json_is_the_same_for_both_versions(use_fixture) -> None:  # type: ignore[no-untyped-def]
    outputs = []
    for version in ("22.05", "24.11"):
        use_fixture(version, "sinfo_drained.json")
        result = CliRunner().invoke(cli, ["nodes", "--json"])
        assert result.exit_code == 0
        outputs.append(sorted(json.loads(result.output), key=lambda row: row["name"]))
    assert (
        outputs[0]
        == outputs[1]
        == [
            {"name": "n1", "state": "MIXED", "flags": [], "reason": None, "partitions": ["debug"], "cpus": 2},
            {
                "name": "n2",
                "state": "IDLE",
                "flags": ["DRAIN"],
                "reason": "tp: planned maintenance",
                "partitions": ["debug"],
                "cpus": 2,
            },
        ]
    )


def test_nodes_partition_filter(use_fixture) -> None:  # type: ignore[no-untyped-def]
    use_fixture("22.05", "sinfo_idle.json")
    result = CliRunner().invoke(cli, ["nodes", "--json", "--partition", "gpu"])
    assert (result.exit_code, result.output) == (0, "[]\n")


def test_nodes_error_is_rendered_once_with_exit_code(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    runner = FakeRunner().on(["sinfo", "--json"], SlurmNotFoundError("sinfo"))
    monkeypatch.setattr(nodes_module, "select_backend", lambda: CliSlurm(runner))
    assert run_cli(cli, ["nodes"], prog_name="tp") == 3
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        "error: the Slurm command `sinfo` was not found on PATH\n"
        "  hint: run this on a Slurm login or compute node, or add Slurm's bin directory to PATH.\n"
    )


def test_nodes_parse_error_exit_code(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    runner = FakeRunner().on(["sinfo", "--json"], "garbage")
    monkeypatch.setattr(nodes_module, "select_backend", lambda: CliSlurm(runner))
    assert run_cli(cli, ["nodes"], prog_name="tp") == 3
    assert capsys.readouterr().err.startswith(
        "error: could not parse sinfo --json output: not JSON (Expecting value at line 1) "
        "(output began: 'garbage')\n"
    )


def test_hostlist_expand() -> None:
    result = CliRunner().invoke(cli, ["hostlist", "expand", "n[1-3],gpu01"])
    assert (result.exit_code, result.output) == (0, "n1\nn2\nn3\ngpu01\n")


def test_hostlist_compress() -> None:
    result = CliRunner().invoke(cli, ["hostlist", "compress", "n3", "n1", "n2"])
    assert (result.exit_code, result.output) == (0, "n[1-3]\n")


def test_hostlist_expand_malformed(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(cli, ["hostlist", "expand", "n[1-"], prog_name="tp") == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        "error: malformed hostlist 'n[1-': unbalanced brackets\n"
        "  hint: write ranges as prefix[a-b,c], e.g. 'n[1-3,7]'.\n"
    )


def test_hostlist_compress_needs_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(cli, ["hostlist", "compress"], prog_name="tp") == 2
    assert "Missing argument 'NAMES...'" in capsys.readouterr().err


def test_help_lists_commands_without_importing_them() -> None:
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    assert "hostlist  Expand or compress a Slurm hostlist." in result.output
    assert "nodes     Show the cluster's nodes as Slurm reports them." in result.output
