"""tp-submit's command line: ``[OPTIONS] SCRIPT [ARGS...]`` or ``[OPTIONS] -- COMMAND...`` (pure)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from torchpass_slurm.errors import SubmitError
from torchpass_slurm.submit.options import COMMAND_LINE, COMMAND_LINE_OPTIONS, Option, parse_options

__all__ = ["SubmitRequest", "parse_submit_args"]


@dataclass(frozen=True)
class SubmitRequest:
    """tp-submit's command line, parsed but not yet checked or merged with the script."""

    options: tuple[Option, ...] = ()
    script: str | None = None
    script_args: tuple[str, ...] = ()
    command: tuple[str, ...] = ()

    def has(self, name: str) -> bool:
        return any(o.name == name for o in self.options)

    @property
    def help(self) -> bool:
        return self.has("help")

    @property
    def dry_run(self) -> bool:
        return self.has("dry-run")


def parse_submit_args(argv: Sequence[str]) -> SubmitRequest:
    """Parse ``[OPTIONS] SCRIPT [ARGS...]`` or ``[OPTIONS] -- COMMAND...`` (pure).

    As with sbatch, everything after SCRIPT belongs to the script. Values are
    checked later, by :func:`resolve_job_spec`, once merged with the script's lines.
    """
    options, rest = parse_options(list(argv), COMMAND_LINE_OPTIONS, COMMAND_LINE)
    request = SubmitRequest(options=tuple(options))
    if any(o.name == "help" for o in options):
        return request
    if not rest:
        raise SubmitError(
            "no batch script and no command given",
            hint="usage: tp-submit [OPTIONS] SCRIPT [ARGS...]  or  tp-submit [OPTIONS] -- COMMAND...",
        )
    if rest[0] == "--":
        if len(rest) == 1:
            raise SubmitError(
                "nothing after `--`: expected the command to run",
                hint="e.g. tp-submit -N 2 --spares 1 -- python train.py",
            )
        return replace(request, command=tuple(rest[1:]))
    if rest[0] == "-":
        raise SubmitError(
            "tp-submit cannot read the batch script from stdin",
            hint="give the script's file name, or use -- COMMAND...",
        )
    return replace(request, script=rest[0], script_args=tuple(rest[1:]))
