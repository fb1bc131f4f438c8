"""One exception tree for the whole package.

Errors are raised where the failure happens, carry what was seen and what to do
next, and are rendered once, at the command-line boundary
(:mod:`torchpass_slurm.cli.app`), which maps them to exit codes.

::

    TorchpassError                 exit 1
    ├── ConfigError                exit 2   bad flag value, bad config file
    ├── HostlistError              exit 2   malformed Slurm hostlist
    ├── SubmitError                exit 2   tp-submit refused the job; nothing was submitted
    ├── RunDirError                exit 1   what the user named is not a run folder, or its job has none
    ├── StatusError                exit 1   a job's status file is missing or malformed
    ├── EventLogError              exit 1   the event log could not be written, or read back in full
    ├── MembershipError            exit 1   a membership change that does not fit the membership
    │   └── NoSpareError                    an active node failed and no spare is left
    ├── ControlPlaneError          exit 4   the supervisor/worker control plane failed
    │   └── AuthenticationError             a message failed its HMAC or replay check
    ├── CheckpointError            exit 5   a checkpoint could not be written or read
    ├── TransferError              exit 6   a state transfer failed (peer gone, corrupt data, bad manifest)
    │   └── TransferTimeout                 one transport call did not finish within its timeout
    ├── NoReplicaError             exit 6   a sharded rank is behind and no rank holds its shard: restart
    ├── CollectiveError            exit 1   a data-plane collective failed (a peer died); the loop recovers
    │   └── RendezvousTimeout               not every rank arrived at an epoch's rendezvous in time
    ├── SourceError                exit 3   a health check's device library failed (not the node)
    └── SlurmError                 exit 3   anything that went wrong talking to Slurm
        ├── SlurmCommandError               a command exited non-zero (argv, code, stderr)
        │   └── SlurmTimeoutError           a command ran past its timeout
        ├── SlurmNotFoundError              the command is not installed / not on PATH
        └── SlurmParseError                 output that does not parse as expected

Any other exception reaching the boundary is a bug: the CLI prints one line
naming the log file that holds its traceback and exits with 70
(``EXIT_INTERNAL``).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "TorchpassError",
    "ConfigError",
    "HostlistError",
    "SubmitError",
    "RunDirError",
    "StatusError",
    "EventLogError",
    "MembershipError",
    "NoSpareError",
    "ControlPlaneError",
    "AuthenticationError",
    "CheckpointError",
    "TransferError",
    "TransferTimeout",
    "NoReplicaError",
    "CollectiveError",
    "RendezvousTimeout",
    "SourceError",
    "SlurmError",
    "SlurmCommandError",
    "SlurmTimeoutError",
    "SlurmNotFoundError",
    "SlurmParseError",
]


class TorchpassError(Exception):
    """Base of every error this package raises on purpose.

    ``message`` says what was seen and what was expected; ``hint`` (optional)
    says what the user can do next. ``exit_code`` is what the CLI exits with.
    """

    exit_code: int = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message}\n  hint: {self.hint}"
        return self.message


class ConfigError(TorchpassError):
    """A setting (flag, environment variable, config file) has a bad value."""

    exit_code = 2


class HostlistError(TorchpassError):
    """A Slurm hostlist expression could not be expanded or compressed."""

    exit_code = 2


class SubmitError(TorchpassError):
    """tp-submit refused a job before submitting anything."""

    exit_code = 2


class RunDirError(TorchpassError):
    """What the user named is not a run folder, or its job has none."""


class StatusError(TorchpassError):
    """The status file is missing or unreadable."""


class EventLogError(TorchpassError):
    """The event log could not be written, or read back in full."""


class MembershipError(TorchpassError):
    """A membership change or query that does not fit the current membership."""


class NoSpareError(MembershipError):
    """An active node failed and no spare is left to take its place."""


class ControlPlaneError(TorchpassError):
    """The authenticated control plane between supervisor and workers failed."""

    exit_code = 4


class AuthenticationError(ControlPlaneError):
    """A control message failed authentication (bad HMAC, replay, unknown sender)."""


class CheckpointError(TorchpassError):
    """A checkpoint could not be saved or loaded."""

    exit_code = 5


class TransferError(TorchpassError):
    """Moving a training state between two ranks failed.

    A transport that raised is broken: every later call raises ``TransferError``
    again. Build a new transport (a new connection, or the next epoch's process
    group) and retry; :class:`~torchpass_slurm.transfer.stream.ReceiveProgress`
    lets the retry resume where the failed one stopped.
    """

    exit_code = 6


class TransferTimeout(TransferError):
    """A transport call did not complete within its ``timeout``."""


class NoReplicaError(TorchpassError):
    """A rank of a sharded job is behind and no rank holds its shard at the agreed step.

    Pure FSDP (no replicate dimension) after an unplanned loss, or a shard whose every
    replica was lost: the state exists nowhere, so a live migration cannot restore it. Not
    a failed collective, so the elastic loop does not wait for another epoch; the job
    restarts from its newest checkpoint (the supervisor plans that before the ranks see it;
    this is the ranks' last line of defence).
    """

    exit_code = 6


class CollectiveError(TorchpassError):
    """A collective of the data plane failed: a peer died or the network broke, not a bug.

    The elastic loop answers it by waiting for the supervisor's reconfigure.
    """


class RendezvousTimeout(CollectiveError):
    """Not every rank arrived at an epoch's rendezvous in time."""


class SourceError(TorchpassError):
    """The device source itself failed (library missing or broken, init failed, timed out).

    Every GPU check becomes UNKNOWN: the node may be fine, the check is not.
    """

    exit_code = 3


class SlurmError(TorchpassError):
    """Something went wrong while talking to Slurm."""

    exit_code = 3


def _quote_argv(argv: Sequence[str]) -> str:
    import shlex

    return " ".join(shlex.quote(a) for a in argv)


class SlurmCommandError(SlurmError):
    """A Slurm command exited with a non-zero status.

    Carries the full ``argv``, the ``returncode`` and the command's ``stderr``
    exactly as Slurm wrote it, so that the user sees Slurm's own words.
    """

    def __init__(
        self,
        argv: Sequence[str],
        returncode: int | None,
        stderr: str,
        *,
        stdout: str = "",
        hint: str | None = None,
        message: str | None = None,
    ) -> None:
        self.argv = tuple(argv)
        self.returncode = returncode
        self.stderr = stderr
        self.stdout = stdout
        if message is None:
            said = stderr.strip() or "(nothing on stderr)"
            message = f"`{_quote_argv(argv)}` exited with status {returncode}: {said}"
        super().__init__(message, hint=hint)


class SlurmTimeoutError(SlurmCommandError):
    """A Slurm command did not finish within its timeout (``returncode`` is None)."""

    def __init__(
        self, argv: Sequence[str], timeout: float, stderr: str = "", *, hint: str | None = None
    ) -> None:
        self.timeout = timeout
        super().__init__(
            argv,
            None,
            stderr,
            hint=hint
            or "slurmctld may be overloaded or unreachable; check `scontrol ping` and retry, "
            "or raise the timeout (TORCHPASS_SLURM_TIMEOUT).",
            message=f"`{_quote_argv(argv)}` did not finish within {timeout:g} s",
        )


class SlurmNotFoundError(SlurmError):
    """A Slurm command is not installed or not on ``PATH``."""

    def __init__(self, command: str) -> None:
        self.command = command
        super().__init__(
            f"the Slurm command `{command}` was not found on PATH",
            hint="run this on a Slurm login or compute node, or add Slurm's bin directory to PATH.",
        )


class SlurmParseError(SlurmError):
    """Slurm's output did not have the expected form."""

    def __init__(self, what: str, detail: str, *, excerpt: str = "") -> None:
        self.what = what
        self.detail = detail
        self.excerpt = excerpt[:200]
        msg = f"could not parse {what}: {detail}"
        if self.excerpt:
            msg += f" (output began: {self.excerpt!r})"
        super().__init__(
            msg,
            hint="this Slurm version may print a schema torchpass-slurm does not know yet; "
            "please report it with the output of `sinfo --version`.",
        )
