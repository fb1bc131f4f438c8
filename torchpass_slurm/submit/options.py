"""The options tp-submit knows, and the parser of option words.

sbatch has about a hundred options; tp-submit needs its table only to know
whether ``--opt`` swallows the next word, so that the rest can go to sbatch
unchanged and in order. :func:`parse_options` reads the options at the front
of a list of words, for the command line
(:mod:`~torchpass_slurm.submit.command_line`) and for ``#SBATCH`` / ``#TP``
lines (:mod:`~torchpass_slurm.submit.batch_script`) alike. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torchpass_slurm.errors import SubmitError

__all__ = [
    "COMMAND_LINE",
    "COMMAND_LINE_OPTIONS",
    "FLAG",
    "OPTIONAL",
    "REQUIRED",
    "SBATCH_OPTIONS",
    "TP_LINE_OPTIONS",
    "TP_OPTIONS",
    "UNDERSTOOD",
    "Option",
    "parse_options",
]

REQUIRED, OPTIONAL, FLAG = "required", "optional", "flag"

#: long option name -> (short letter or "", REQUIRED / OPTIONAL / FLAG)
_Table = Mapping[str, tuple[str, str]]


def _table(spec: str, kind: str) -> dict[str, tuple[str, str]]:
    """``"nodes:N time:t wrap"`` -> {"nodes": ("N", kind), "time": ("t", kind), "wrap": ("", kind)}."""
    table = {}
    for item in spec.split():
        name, _, short = item.partition(":")
        table[name] = (short, kind)
    return table


#: sbatch's options (Slurm 24.11): long name -> (short letter or "", how it takes a value).
#: tp-submit needs this only to know whether ``--opt`` swallows the next word.
SBATCH_OPTIONS: dict[str, tuple[str, str]] = {
    **_table(
        """account:A acctg-freq array:a batch bb bbf begin:b chdir:D cluster-constraint
        clusters:M comment constraint:C container container-id core-spec:S cores-per-socket
        cpu-freq cpus-per-gpu cpus-per-task:c deadline delay-boot dependency:d distribution:m
        error:e exclude:x export export-file extra extra-node-info:B gid gpu-bind gpu-freq
        gpus:G gpus-per-node gpus-per-socket gpus-per-task gres gres-flags hint input:i
        job-name:J kill-on-invalid-dep licenses:L mail-type mail-user mcs-label mem mem-bind
        mem-per-cpu mem-per-gpu mincpus network nodefile:F nodelist:w nodes:N ntasks:n
        ntasks-per-core ntasks-per-gpu ntasks-per-node ntasks-per-socket open-mode output:o
        partition:p power prefer priority profile qos:q reservation segment signal
        sockets-per-node switches thread-spec threads-per-core time:t time-min tmp tres-bind
        tres-per-task uid wait-all-nodes wckey wrap""",
        REQUIRED,
    ),
    **_table("exclusive get-user-env nice no-kill:k oom-kill-step propagate", OPTIONAL),
    **_table(
        """contiguous help:h hold:H ignore-pbs no-requeue overcommit:O oversubscribe:s parsable
        quiet:Q reboot requeue spread-job stepmgr test-only usage:u use-min-nodes verbose:v
        version:V wait:W""",
        FLAG,
    ),
}

#: tp-submit's own options: on the command line, and the first five in ``#TP`` lines.
TP_OPTIONS: dict[str, tuple[str, str]] = _table(
    "spares spare-wait run-dir supervisor-partition transport dry-run", REQUIRED
)
TP_OPTIONS["dry-run"] = ("", FLAG)
TP_OPTIONS["debug"] = ("", FLAG)
#: The options a ``#TP`` line may hold.
TP_LINE_OPTIONS = {
    name: TP_OPTIONS[name]
    for name in ("spares", "spare-wait", "run-dir", "supervisor-partition", "transport")
}
#: Everything tp-submit's command line may hold.
COMMAND_LINE_OPTIONS = {**SBATCH_OPTIONS, **TP_OPTIONS}

#: Options tp-submit reads and then passes to sbatch in its own form (or not at all).
UNDERSTOOD = frozenset(
    {
        "nodes",
        "ntasks",
        "ntasks-per-node",
        "partition",
        "output",
        "job-name",
        "chdir",
        "no-kill",
        "parsable",
        "help",
        "comment",
    }
) | frozenset(TP_OPTIONS)

#: The origin of an option given on tp-submit's command line.
COMMAND_LINE = "the command line"


@dataclass(frozen=True)
class Option:
    """One option as it was given: ``name`` is the long name (without ``--``)."""

    name: str
    value: str | None
    #: The words as written, passed to sbatch unchanged if tp-submit does not consume it.
    tokens: tuple[str, ...]
    #: Where it came from: "the command line" or "train.sh line 3".
    origin: str = COMMAND_LINE

    def __str__(self) -> str:
        shown = " ".join(self.tokens)
        return shown if self.origin == COMMAND_LINE else f"{shown} ({self.origin})"


def _match(given: str, table: _Table, origin: str) -> str | None:
    """The long option ``given`` names: exact, or a unique prefix (like getopt_long)."""
    if given in table:
        return given
    found = sorted(n for n in table if n.startswith(given))
    if len(found) > 1:
        raise SubmitError(
            f"--{given} ({origin}) is ambiguous: it could be --{', --'.join(found)}",
            hint="write the option out in full",
        )
    return found[0] if found else None


def _take_value(name: str, words: list[str], origin: str) -> str:
    if not words:
        raise SubmitError(f"--{name} ({origin}) needs a value", hint=f"write --{name}=VALUE")
    return words.pop(0)


def _parse_long(word: str, words: list[str], table: _Table, origin: str) -> Option:
    given, eq, value = word[2:].partition("=")
    name = _match(given, table, origin)
    if name is None:  # not ours to judge: sbatch gets it as written
        return Option(given, value if eq else None, (word,), origin)
    kind = table[name][1]
    if kind == FLAG and eq:
        raise SubmitError(f"--{name} ({origin}) takes no value, but was given {word!r}")
    if kind == REQUIRED and not eq:
        value = _take_value(name, words, origin)
        return Option(name, value, (word, value), origin)
    return Option(name, value if eq else None, (word,), origin)


def _parse_short(word: str, words: list[str], table: _Table, origin: str) -> list[Option]:
    by_letter = {short: name for name, (short, _) in table.items() if short}
    found = []
    i = 1
    while i < len(word):
        letter = word[i]
        name = by_letter.get(letter)
        if name is None:
            raise SubmitError(
                f"unknown option -{letter} in {word!r} ({origin})",
                hint="see `tp-submit --help` and `man sbatch`",
            )
        kind, rest = table[name][1], word[i + 1 :]
        if kind == FLAG:
            found.append(Option(name, None, (f"-{letter}",), origin))
            i += 1
            continue
        if rest or kind == OPTIONAL:  # -N3; an optional value must be attached (-koff)
            found.append(Option(name, rest or None, (f"-{letter}{rest}",), origin))
        else:
            value = _take_value(name, words, origin)
            found.append(Option(name, value, (f"-{letter}", value), origin))
        break
    return found


def parse_options(words: list[str], table: _Table, origin: str) -> tuple[list[Option], list[str]]:
    """Options from the front of ``words``; returns them and what follows (from a
    positional word or from ``--`` on, both included)."""
    options: list[Option] = []
    while words:
        word = words[0]
        if word == "--" or not word.startswith("-") or word == "-":
            break
        words.pop(0)
        if word.startswith("--"):
            options.append(_parse_long(word, words, table, origin))
        else:
            options.extend(_parse_short(word, words, table, origin))
    return options, words
