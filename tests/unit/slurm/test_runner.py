"""SubprocessRunner against tiny real programs placed first on PATH (no Slurm)."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from tests.unit.processes import gone_within
from torchpass_slurm.errors import (
    ConfigError,
    SlurmCommandError,
    SlurmNotFoundError,
    SlurmTimeoutError,
)
from torchpass_slurm.slurm.runner import (
    DEFAULT_TIMEOUT_S,
    TIMEOUT_ENV,
    Runner,
    SubprocessRunner,
    default_timeout,
)


@pytest.fixture
def bin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory put first on PATH, where tests write fake Slurm commands."""
    d = tmp_path / "bin"
    d.mkdir()
    monkeypatch.setenv("PATH", f"{d}{os.pathsep}{os.environ['PATH']}")
    return d


def write_script(bin_dir: Path, name: str, body: str) -> Path:
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_subprocess_runner_is_a_runner() -> None:
    assert isinstance(SubprocessRunner(timeout=1), Runner)


def test_success_returns_stdout_and_passes_stdin(bin_dir: Path) -> None:
    write_script(bin_dir, "sbatch", 'cat >/dev/null; echo "42;tpfix"')
    result = SubprocessRunner(timeout=5).run(["sbatch", "--parsable"], input="#!/bin/sh\n")
    assert result.stdout == "42;tpfix\n"
    assert result.argv == ("sbatch", "--parsable")
    assert result.returncode == 0


def test_arguments_are_not_shell_interpreted(bin_dir: Path, tmp_path: Path) -> None:
    write_script(bin_dir, "scontrol", 'printf "%s|" "$@"')
    marker = tmp_path / "pwned"
    arg = f"Reason=x; touch {marker}"
    out = SubprocessRunner(timeout=5).run(["scontrol", "update", arg]).stdout
    assert out == f"update|{arg}|"
    assert not marker.exists()


def test_env_is_the_commands_environment(bin_dir: Path) -> None:
    write_script(bin_dir, "sinfo", 'echo "$TP_X"')
    env = {**os.environ, "TP_X": "seen"}
    assert SubprocessRunner(timeout=5).run(["sinfo"], env=env).stdout == "seen\n"


def test_timeout_raises_timeout_error(bin_dir: Path) -> None:
    write_script(bin_dir, "sinfo", "sleep 30")
    started = time.monotonic()
    with pytest.raises(SlurmTimeoutError) as info:
        SubprocessRunner(timeout=0.3).run(["sinfo", "--json"])
    assert time.monotonic() - started < 10
    err = info.value
    assert err.argv == ("sinfo", "--json")
    assert err.returncode is None
    assert err.timeout == 0.3
    assert err.message == "`sinfo --json` did not finish within 0.3 s"
    assert err.exit_code == 3
    assert "TORCHPASS_SLURM_TIMEOUT" in (err.hint or "")


def test_per_call_timeout_overrides_default(bin_dir: Path) -> None:
    write_script(bin_dir, "squeue", "sleep 30")
    with pytest.raises(SlurmTimeoutError) as info:
        SubprocessRunner(timeout=60).run(["squeue"], timeout=0.2)
    assert info.value.timeout == 0.2


def test_nonzero_exit_carries_argv_code_and_stderr(bin_dir: Path) -> None:
    write_script(bin_dir, "scontrol", 'echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1')
    with pytest.raises(SlurmCommandError) as info:
        SubprocessRunner(timeout=5).run(["scontrol", "-o", "show", "job", "999999"])
    err = info.value
    assert err.argv == ("scontrol", "-o", "show", "job", "999999")
    assert err.returncode == 1
    assert err.stderr == "slurm_load_jobs error: Invalid job id specified\n"
    assert err.message == (
        "`scontrol -o show job 999999` exited with status 1: slurm_load_jobs error: Invalid job id specified"
    )
    assert "scontrol ping" in (err.hint or "")
    assert not isinstance(err, SlurmTimeoutError)


def test_missing_command_raises_not_found(bin_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(bin_dir))
    with pytest.raises(SlurmNotFoundError) as info:
        SubprocessRunner(timeout=5).run(["sinfo", "--json"])
    assert info.value.command == "sinfo"
    assert info.value.message == "the Slurm command `sinfo` was not found on PATH"


def test_spawn_returns_a_running_process(bin_dir: Path) -> None:
    write_script(bin_dir, "srun", "exit 7")
    proc = SubprocessRunner(timeout=5).spawn(["srun", "--no-kill", "true"], env=dict(os.environ))
    assert proc.wait(timeout=10) == 7


def test_spawn_missing_command(bin_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(bin_dir))
    with pytest.raises(SlurmNotFoundError):
        SubprocessRunner(timeout=5).spawn(["srun"])


def test_default_timeout_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert default_timeout() == DEFAULT_TIMEOUT_S
    monkeypatch.setenv(TIMEOUT_ENV, "7.5")
    assert default_timeout() == 7.5
    assert SubprocessRunner().timeout == 7.5


@pytest.mark.parametrize("bad", ["soon", "0", "-3", "nan"])
def test_bad_timeout_setting_is_a_config_error(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    monkeypatch.setenv(TIMEOUT_ENV, bad)
    with pytest.raises(ConfigError) as info:
        default_timeout()
    assert info.value.message == f"{TIMEOUT_ENV}={bad!r} is not a positive number of seconds"


def test_a_timed_out_command_is_killed_with_what_it_forked(bin_dir: Path, tmp_path: Path) -> None:
    """A hung scontrol that forked: its child holds the pipes; both die at the timeout."""
    pidfile = tmp_path / "helper.pid"
    write_script(bin_dir, "scontrol", f"sleep 30 & echo $! > {pidfile}; sleep 30")
    began = time.monotonic()
    with pytest.raises(SlurmTimeoutError):
        SubprocessRunner(timeout=0.5).run(["scontrol", "ping"])
    took = time.monotonic() - began
    assert took < 5, f"the call waited {took:.1f} s for the forked helper's pipes"
    assert gone_within(int(pidfile.read_text()), 5), "the command's forked helper outlived the timeout"
