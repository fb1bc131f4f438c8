"""The error boundary (`run_cli`): package errors as today, anything else one line, a log file, exit 70."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest
from click.testing import CliRunner

from torchpass_slurm import __version__
from torchpass_slurm.cli import app as app_module
from torchpass_slurm.cli import hostlist as hostlist_cli
from torchpass_slurm.cli import submit as submit_cli
from torchpass_slurm.cli.app import EXIT_INTERNAL, run_cli

from .conftest import tp


class Outcome(NamedTuple):
    code: int
    out: str
    err: str


def tp_submit(*argv: str) -> Outcome:
    with CliRunner().isolation() as (out, err, _):
        code = run_cli(submit_cli.tp_submit, list(argv), prog_name="tp-submit")
    return Outcome(code, out.getvalue().decode(), err.getvalue().decode())


def boom(*args: object) -> None:
    raise RuntimeError("boom\nsecond line")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``$XDG_CACHE_HOME`` in the test's folder; the logs' folder inside it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "torchpass-slurm"


def the_log(folder: Path, prog: str) -> Path:
    [log] = folder.iterdir()
    assert log.name.startswith(f"{prog}-") and log.suffix == ".log"
    return log


def test_a_package_error_is_rendered_as_before(cache: Path) -> None:
    result = tp("hostlist", "expand", "n[3-1]")
    assert result.code == 2 and result.out == ""
    assert result.err.startswith("error: ") and "Traceback" not in result.err
    assert not cache.exists()


def test_a_bug_is_one_line_naming_the_log_and_exits_70(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostlist_cli, "expand_expr", boom)
    result = tp("hostlist", "expand", "n[1-2]")
    log = the_log(cache, "tp")
    assert result == (
        EXIT_INTERNAL,
        "",
        "error: internal error in tp (a bug, please report it): RuntimeError: boom; "
        f"the traceback is in {log}\n",
    )
    text = log.read_text()
    assert text.startswith("tp: internal error at ")
    assert "command: tp hostlist expand n[1-2]\n" in text
    assert f"torchpass-slurm {__version__}, Python " in text
    assert "Traceback (most recent call last):" in text and text.endswith("RuntimeError: boom\nsecond line\n")


def test_debug_shows_the_traceback_on_stderr(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostlist_cli, "expand_expr", boom)
    result = tp("--debug", "hostlist", "expand", "n[1-2]")
    log = the_log(cache, "tp")
    shown, line = result.err[:-1].rsplit("\n", 1)
    assert (result.code, result.out) == (EXIT_INTERNAL, "")
    assert shown.startswith("Traceback (most recent call last):\n")
    assert shown.endswith("RuntimeError: boom\nsecond line")
    assert line == (
        "error: internal error in tp (a bug, please report it): RuntimeError: boom; "
        f"the traceback is in {log}"
    )
    assert log.read_text().endswith(shown + "\n")


def test_no_writable_folder_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "file").write_text("")
    folders = [tmp_path / "file" / "cache", tmp_path / "file" / "tmp"]  # inside a file: never made
    monkeypatch.setattr(app_module, "log_folders", lambda: folders)
    monkeypatch.setattr(hostlist_cli, "expand_expr", boom)
    result = tp("hostlist", "expand", "n1")
    assert result == (
        EXIT_INTERNAL,
        "",
        "error: internal error in tp (a bug, please report it): RuntimeError: boom; "
        f"the traceback could not be written ({folders[0]}, {folders[1]}); "
        "rerun with --debug\n",
    )


def test_tp_submit_has_debug_too(cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.sh").write_text("#!/bin/bash\ntp run python train.py\n")
    monkeypatch.setattr(submit_cli, "make_submitter", boom)
    quiet = tp_submit("-N", "1", "train.sh")
    log = the_log(cache, "tp-submit")
    assert quiet == (
        EXIT_INTERNAL,
        "",
        "error: internal error in tp-submit (a bug, please report it): "
        f"RuntimeError: boom; the traceback is in {log}\n",
    )
    log.unlink()
    loud = tp_submit("--debug", "-N", "1", "train.sh")
    assert loud.code == EXIT_INTERNAL and loud.err.startswith("Traceback (most recent call last):\n")
    assert "command: tp-submit --debug -N 1 train.sh\n" in the_log(cache, "tp-submit").read_text()


def test_tp_submit_does_not_pass_debug_to_sbatch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    class Sized:
        def partition_node_count(self, partition: str | None) -> int:
            return 4

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.sh").write_text("#!/bin/bash\ntp run python train.py\n")
    monkeypatch.setattr(submit_cli, "make_submitter", Sized)
    result = tp_submit("--debug", "--dry-run", "-N", "1", "--run-dir", "r", "train.sh")
    [sbatch] = [line for line in result.out.splitlines() if line.startswith("sbatch ")]
    assert result.code == 0 and "--debug" not in sbatch, result


def test_an_interrupt_is_not_an_internal_error(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(expr: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(hostlist_cli, "expand_expr", interrupted)
    assert tp("hostlist", "expand", "n1") == (130, "", "\naborted\n")  # click turns it into Abort
    assert not cache.exists()


def test_help_lists_debug() -> None:
    result = tp("--help")
    assert result.code == 0 and "--debug" in result.out
