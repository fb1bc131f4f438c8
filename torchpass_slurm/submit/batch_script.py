"""A user's batch script: its ``#!`` line, its ``#SBATCH`` / ``#TP`` directives, the rest (pure)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from torchpass_slurm.errors import SubmitError
from torchpass_slurm.submit.options import SBATCH_OPTIONS, TP_LINE_OPTIONS, TP_OPTIONS, Option, parse_options

__all__ = ["BatchScript", "parse_batch_script"]


@dataclass(frozen=True)
class BatchScript:
    """A user's batch script: its ``#!`` line, its directives, and the rest."""

    source: str
    shebang: str
    directives: tuple[Option, ...]
    #: Everything after the ``#!`` line, unchanged.
    body: str


def _directive_words(text: str, origin: str) -> list[str]:
    try:
        return shlex.split(text, comments=True)
    except ValueError as exc:
        raise SubmitError(f"cannot parse {origin}: {exc}") from None


def _parse_directive(line: str, origin: str) -> list[Option]:
    """Options from one ``#SBATCH`` or ``#TP`` line."""
    m = re.match(r"(#SBATCH|#TP)(?:\s+(.*))?$", line)
    assert m is not None, line
    tag, text = m.group(1), m.group(2) or ""
    table = SBATCH_OPTIONS if tag == "#SBATCH" else TP_LINE_OPTIONS
    options, rest = parse_options(_directive_words(text, origin), table, origin)
    if rest:
        raise SubmitError(
            f"{origin}: unexpected {rest[0]!r} in {line.strip()!r}", hint=f"{tag} lines hold options only"
        )
    for o in options:
        if tag == "#SBATCH" and o.name in TP_OPTIONS:
            raise SubmitError(
                f"{origin}: --{o.name} is tp-submit's option; sbatch does not know it",
                hint=f"write it as `#TP {' '.join(o.tokens)}`",
            )
        if tag == "#TP" and o.name not in TP_LINE_OPTIONS:
            raise SubmitError(
                f"{origin}: {' '.join(o.tokens)} is not allowed in a #TP line",
                hint="#TP lines take --spares and --run-dir; sbatch options go in #SBATCH lines",
            )
    return options


def parse_batch_script(text: str, source: str) -> BatchScript:
    """Split a batch script into its ``#!`` line, its directives and the rest (pure).

    Like sbatch, directives are read only from the leading block of comments and
    blank lines; the first other line ends it. ``#TP --spares=S`` lines carry
    tp-submit's own options there.
    """
    lines = text.splitlines(keepends=True)
    if not lines or not lines[0].startswith("#!"):
        raise SubmitError(
            f"the batch script {source} does not start with a #! line",
            hint="sbatch needs one too: make its first line e.g. #!/bin/bash",
        )
    directives: list[Option] = []
    for number, line in enumerate(lines[1:], start=2):
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            break
        if re.match(r"#(SBATCH|TP)(\s|$)", line):
            directives.extend(_parse_directive(line.rstrip("\n"), f"{source} line {number}"))
    return BatchScript(source, lines[0].rstrip("\r\n"), tuple(directives), "".join(lines[1:]))
