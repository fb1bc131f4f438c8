"""Run Slurm commands: the one place in the package that starts a Slurm process.

Every call goes through a :class:`Runner`. The real one,
:class:`SubprocessRunner`, runs an argument list (never a shell string) with a
timeout and turns every way a command can fail into one of the package's
errors:

=============================  ===========================================
what happened                  raised
=============================  ===========================================
the program is not on PATH     :class:`~torchpass_slurm.errors.SlurmNotFoundError`
it ran past its timeout        :class:`~torchpass_slurm.errors.SlurmTimeoutError`
it exited non-zero             :class:`~torchpass_slurm.errors.SlurmCommandError`
=============================  ===========================================

The timeout of a call that does not give its own is :data:`TIMEOUT_ENV`
(``TORCHPASS_SLURM_TIMEOUT``, seconds) or :data:`DEFAULT_TIMEOUT_S`.

Each command runs in a process group of its own, and a command past its
timeout is killed with its whole group: a hung ``scontrol`` that forked
leaves no orphan (in a node's hook, one running as root) holding the
caller's pipes open.

Unit tests inject a fake that implements the same protocol and rejects every
command it was not told about.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torchpass_slurm.errors import (
    ConfigError,
    SlurmCommandError,
    SlurmNotFoundError,
    SlurmTimeoutError,
)

logger = logging.getLogger(__name__)

#: Environment variable: timeout in seconds of one Slurm command.
TIMEOUT_ENV = "TORCHPASS_SLURM_TIMEOUT"

#: Timeout in seconds of one Slurm command when :data:`TIMEOUT_ENV` is unset.
#: Generous: a busy slurmctld can take several seconds to answer; a watcher
#: that polls every few seconds must still never hang forever.
DEFAULT_TIMEOUT_S = 30.0

#: How long to wait for a killed command's pipes to close (its group is gone by then).
KILL_GRACE_S = 2.0

#: Shown with every non-zero exit that has no more specific advice.
GENERIC_HINT = "the message above is Slurm's own; `scontrol ping` checks that the controller answers."


def default_timeout() -> float:
    """Timeout of one Slurm command: :data:`TIMEOUT_ENV` if set, else the default.

    Raises :class:`ConfigError` when the variable is not a positive number.
    """
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(
            f"{TIMEOUT_ENV}={raw!r} is not a positive number of seconds",
            hint=f"unset it to use the default of {DEFAULT_TIMEOUT_S:g} s, or set e.g. {TIMEOUT_ENV}=60.",
        )
    return value


@dataclass(frozen=True)
class CommandResult:
    """What a finished command printed (it exited 0)."""

    argv: tuple[str, ...]
    stdout: str
    stderr: str = ""
    returncode: int = 0


@runtime_checkable
class Runner(Protocol):
    """Runs Slurm commands. ``run`` waits for the end; ``spawn`` does not."""

    def run(
        self,
        argv: Sequence[str],
        *,
        input: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> CommandResult:
        """Run ``argv`` to completion; raise a :class:`SlurmError` unless it exits 0.

        ``env`` is the complete environment of the command (None: inherit ours).
        """
        ...

    def spawn(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` (e.g. a long ``srun`` step) and return at once; no timeout.

        The caller owns the process: it must ``wait()``/``terminate()`` it.
        """
        ...


class SubprocessRunner:
    """The real :class:`Runner`: :mod:`subprocess`, argument lists, a timeout each call."""

    def __init__(self, timeout: float | None = None) -> None:
        self.timeout = default_timeout() if timeout is None else timeout

    def run(
        self,
        argv: Sequence[str],
        *,
        input: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> CommandResult:
        argv = tuple(argv)
        limit = self.timeout if timeout is None else timeout
        started = time.monotonic()
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=dict(env) if env is not None else None,
                start_new_session=True,  # its own process group, killed as one
            )
        except FileNotFoundError:
            raise SlurmNotFoundError(argv[0]) from None
        try:
            stdout, stderr = proc.communicate(input, timeout=limit)
        except subprocess.TimeoutExpired as exc:
            kill_group(proc)
            raise SlurmTimeoutError(argv, limit, _text(exc.stderr)) from None
        except BaseException:
            kill_group(proc)
            raise
        logger.debug("%s -> %d in %.2f s", argv, proc.returncode, time.monotonic() - started)
        if proc.returncode != 0:
            raise SlurmCommandError(argv, proc.returncode, stderr, stdout=stdout, hint=GENERIC_HINT)
        return CommandResult(argv, stdout, stderr, proc.returncode)

    def spawn(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
        argv = tuple(argv)
        logger.debug("spawn %s", argv)
        try:
            return subprocess.Popen(argv, env=dict(env) if env is not None else None)
        except FileNotFoundError:
            raise SlurmNotFoundError(argv[0]) from None


def kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL ``proc``'s process group (it leads one: ``start_new_session``) and reap ``proc``.

    Only for a ``proc`` not yet reaped, so its pid, the group's id, cannot have been reused.
    The pipes close with the group, so reading what is left never waits for an orphan."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired, ValueError, OSError):
        proc.communicate(timeout=KILL_GRACE_S)
    if proc.returncode is None:
        proc.kill()
        proc.wait()


def _text(data: str | bytes | None) -> str:
    if data is None:
        return ""
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data
