"""tp-submit's core: command line and ``#SBATCH`` lines -> JobSpec -> batch script -> job id.

The flow, and which pieces are pure::

    argv ──parse_submit_args──► SubmitRequest ─┐
    SCRIPT text ──parse_batch_script──► BatchScript ─┤ (both pure)
                                                 ▼
                            resolve_job_spec ──► JobSpec (frozen, every value resolved; pure)
                                                 │
         check_script_interpreter / check_command / check_run_dir / check_partition_fits
                                                 │   (look at this node; refuse before submitting)
                                                 ▼
                 render_batch_script(spec), sbatch_arguments(spec)     (pure; golden-file tested)
                                                 │
                              submit(spec, submitter, create_secret) ──► job id

Precedence is sbatch's: the command line wins over ``#SBATCH`` / ``#TP`` lines
of the script, and for an option given twice the later one wins. Options that
tp-submit does not need to understand go to sbatch unchanged and in order.

tp-submit asks sbatch for ``--nodes=N+S --ntasks-per-node=k --no-kill`` and
passes every option on sbatch's command line; the rendered script goes to
sbatch's stdin. Its header exports the TORCHPASS_* variables of
``docs/design/runtime-contract.md``; the script's own ``#SBATCH`` lines end up
after those ``export`` lines, where sbatch no longer reads them.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Protocol

from torchpass_slurm.config import (
    ENV_NODES,
    ENV_NTASKS_PER_NODE,
    ENV_RUN_DIR,
    ENV_SECRET_FILE,
    ENV_SPARES,
)
from torchpass_slurm.errors import SubmitError

__all__ = [
    "Option",
    "SubmitRequest",
    "BatchScript",
    "JobSpec",
    "Submitter",
    "SubmitResult",
    "parse_submit_args",
    "parse_batch_script",
    "read_batch_script",
    "resolve_job_spec",
    "render_batch_script",
    "sbatch_arguments",
    "sbatch_command_line",
    "run_dir_comment",
    "RUN_DIR_COMMENT_PREFIX",
    "check_script_interpreter",
    "check_command",
    "check_run_dir",
    "check_partition_fits",
    "submit",
]

# --- the options ------------------------------------------------------------

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

#: tp-submit's own options: on the command line, and the first two in ``#TP`` lines.
TP_OPTIONS: dict[str, tuple[str, str]] = _table("spares run-dir dry-run", REQUIRED)
TP_OPTIONS["dry-run"] = ("", FLAG)
_TP_LINE_OPTIONS = {name: TP_OPTIONS[name] for name in ("spares", "run-dir")}
_COMMAND_LINE_OPTIONS = {**SBATCH_OPTIONS, **TP_OPTIONS}

#: Options tp-submit reads and then passes to sbatch in its own form (or not at all).
UNDERSTOOD = frozenset(
    "nodes ntasks ntasks-per-node partition output job-name chdir no-kill parsable help comment".split()
) | frozenset(TP_OPTIONS)

#: The job comment tp-submit sets (unless the user gives ``--comment``), so that
#: ``tp status JOBID`` can find the run dir from Slurm alone.
RUN_DIR_COMMENT_PREFIX = "torchpass:run_dir="

#: Interpreters the rendered script may keep: it starts with ``export`` lines.
POSIX_SHELLS = frozenset({"sh", "bash", "dash", "ksh", "mksh", "zsh", "ash", "busybox"})

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


@dataclass(frozen=True)
class BatchScript:
    """A user's batch script: its ``#!`` line, its directives, and the rest."""

    source: str
    shebang: str
    directives: tuple[Option, ...]
    #: Everything after the ``#!`` line, unchanged.
    body: str


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
            raise SubmitError(f"unknown option -{letter} in {word!r} ({origin})",
                              hint="see `tp-submit --help` and `man sbatch`")
        kind, rest = table[name][1], word[i + 1:]
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


def _parse_options(
    words: list[str], table: _Table, origin: str
) -> tuple[list[Option], list[str]]:
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


def parse_submit_args(argv: Sequence[str]) -> SubmitRequest:
    """Parse ``[OPTIONS] SCRIPT [ARGS...]`` or ``[OPTIONS] -- COMMAND...`` (pure).

    As with sbatch, everything after SCRIPT belongs to the script. Values are
    checked later, by :func:`resolve_job_spec`, once merged with the script's lines.
    """
    options, rest = _parse_options(list(argv), _COMMAND_LINE_OPTIONS, COMMAND_LINE)
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
            raise SubmitError("nothing after `--`: expected the command to run",
                              hint="e.g. tp-submit -N 2 --spares 1 -- python train.py")
        return replace(request, command=tuple(rest[1:]))
    if rest[0] == "-":
        raise SubmitError("tp-submit cannot read the batch script from stdin",
                          hint="give the script's file name, or use -- COMMAND...")
    return replace(request, script=rest[0], script_args=tuple(rest[1:]))


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
    table = SBATCH_OPTIONS if tag == "#SBATCH" else _TP_LINE_OPTIONS
    options, rest = _parse_options(_directive_words(text, origin), table, origin)
    if rest:
        raise SubmitError(f"{origin}: unexpected {rest[0]!r} in {line.strip()!r}",
                          hint=f"{tag} lines hold options only")
    for o in options:
        if tag == "#SBATCH" and o.name in TP_OPTIONS:
            raise SubmitError(f"{origin}: --{o.name} is tp-submit's option; sbatch does not know it",
                              hint=f"write it as `#TP {' '.join(o.tokens)}`")
        if tag == "#TP" and o.name not in _TP_LINE_OPTIONS:
            raise SubmitError(f"{origin}: {' '.join(o.tokens)} is not allowed in a #TP line",
                              hint="#TP lines take --spares and --run-dir; "
                              "sbatch options go in #SBATCH lines")
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


# --- the job spec ------------------------------------------------------------


@dataclass(frozen=True)
class JobSpec:
    """Everything tp-submit decided about one job; the input of the rendering."""

    #: Active nodes N, hot spares S, ranks per node k. sbatch gets N+S nodes.
    nodes: int
    spares: int
    ntasks_per_node: int
    job_name: str
    #: Absolute paths on the shared file system.
    run_dir: str
    secret_file: str
    #: What the script or command was given as, for the header ("train.sh", "the command line").
    source: str
    #: Script mode: the user's #! line, the rest of the script and its arguments.
    shebang: str = "#!/bin/bash"
    body: str = ""
    script_args: tuple[str, ...] = ()
    #: Command mode: the command ``tp run`` starts on every node (non-empty in this mode).
    command: tuple[str, ...] = ()
    partition: str | None = None
    #: sbatch's --output as the user gave it; None: ``RUN_DIR/slurm-%j.out``.
    output: str | None = None
    chdir: str | None = None
    #: sbatch's --comment as the user gave it; None: ``torchpass:run_dir=RUN_DIR``.
    comment: str | None = None
    #: Options for sbatch that tp-submit does not interpret, as written, in order.
    sbatch_passthrough: tuple[str, ...] = field(default_factory=tuple)

    @property
    def total_nodes(self) -> int:
        return self.nodes + self.spares


def _last(options: Sequence[Option], name: str) -> Option | None:
    for option in reversed(options):
        if option.name == name:
            return option
    return None


def _count(option: Option | None, what: str, *, minimum: int) -> int | None:
    if option is None:
        return None
    value = (option.value or "").strip()
    if not value.isdigit():
        raise SubmitError(f"{what} must be a whole number, got {option}")
    if int(value) < minimum:
        raise SubmitError(f"{what} must be at least {minimum}, got {option}")
    return int(value)


def _node_count(option: Option | None) -> int | None:
    if option is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", option.value or "")
    if m is None:
        raise SubmitError(f"{option}: the node count must be a whole number, not {option.value!r}",
                          hint="tp needs a fixed number of active nodes, e.g. -N 4")
    low, high = int(m.group(1)), int(m.group(2) or m.group(1))
    if low != high:
        raise SubmitError(
            f"{option}: a range of node counts ({low} to {high}) is not supported",
            hint=f"tp needs a fixed number of active nodes: give one number, e.g. -N {high}, "
            "and add hot spares with --spares",
        )
    if low < 1:
        raise SubmitError(f"{option}: the job needs at least 1 node")
    return low


def _layout(options: Sequence[Option]) -> tuple[int, int]:
    """(N, k) from -N, -n and --ntasks-per-node; every node runs the same k ranks."""
    nodes_opt, ntasks_opt, per_node_opt = (
        _last(options, "nodes"), _last(options, "ntasks"), _last(options, "ntasks-per-node"))
    nodes = _node_count(nodes_opt)
    ntasks = _count(ntasks_opt, "the number of tasks", minimum=1)
    per_node = _count(per_node_opt, "the number of tasks per node", minimum=1)
    if ntasks is None:
        return nodes or 1, per_node or 1
    if nodes is None:
        if per_node is None:
            raise SubmitError(f"{ntasks_opt} alone does not say how many nodes the job needs",
                              hint="give -N/--nodes too (or --ntasks-per-node)")
        nodes = ntasks // per_node
        if nodes * per_node != ntasks:
            raise SubmitError(f"{ntasks_opt} is not a multiple of {per_node_opt}",
                              hint="tp runs the same number of tasks on every node")
        return nodes, per_node
    if per_node is None:
        if ntasks % nodes:
            raise SubmitError(f"{ntasks_opt} tasks do not spread evenly over {nodes_opt} nodes",
                              hint="tp runs the same number of tasks on every node")
        return nodes, ntasks // nodes
    if ntasks != nodes * per_node:
        raise SubmitError(
            f"conflicting task counts: {ntasks_opt} but {nodes_opt} x {per_node_opt} = {nodes * per_node}",
            hint="drop -n/--ntasks: tp-submit derives it from -N and --ntasks-per-node",
        )
    return nodes, per_node


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "job"


def _absolute(path: str, base: str) -> str:
    return os.path.normpath(os.path.join(base, os.path.expanduser(path)))


def resolve_job_spec(
    request: SubmitRequest,
    script: BatchScript | None,
    *,
    cwd: str,
    now: datetime,
    secret_subpath: str = ".torchpass/secret",
) -> JobSpec:
    """Merge the command line over the script's directives and decide every value (pure).

    ``cwd`` is the directory tp-submit runs in, ``now`` names the default run dir,
    ``secret_subpath`` is where :func:`create_secret` will put the secret in the run dir.
    """
    options = (*(script.directives if script else ()), *request.options)
    for option in options:
        if option.name == "wrap":
            raise SubmitError(f"{option}: tp-submit does not take --wrap",
                              hint="write the command after `--`: tp-submit [OPTIONS] -- COMMAND...")
        if option.name == "no-kill" and option.value not in (None, ""):
            raise SubmitError(f"{option}: tp needs --no-kill (a lost node must not end the job)",
                              hint="remove it; tp-submit always passes --no-kill")
    nodes, per_node = _layout(options)
    spares_opt = _last(options, "spares")
    spares = _count(spares_opt, "the number of hot spares", minimum=0) or 0

    def value(name: str) -> str | None:
        option = _last(options, name)
        return None if option is None else option.value

    chdir = value("chdir")
    workdir = _absolute(chdir, cwd) if chdir else cwd
    if script is not None:
        job_name = value("job-name") or os.path.basename(script.source)
    else:
        job_name = value("job-name") or os.path.basename(request.command[0])
    run_dir_given = value("run-dir")
    if run_dir_given:
        run_dir = _absolute(run_dir_given, cwd)
    else:
        run_dir = os.path.join(workdir, "torchpass-runs", f"{_safe_name(job_name)}-{now:%Y%m%d-%H%M%S}")
    passthrough = tuple(w for o in options if o.name not in UNDERSTOOD for w in o.tokens)
    spec = JobSpec(
        nodes=nodes, spares=spares, ntasks_per_node=per_node, job_name=job_name,
        run_dir=run_dir, secret_file=os.path.join(run_dir, secret_subpath),
        source=script.source if script else COMMAND_LINE,
        partition=value("partition"), output=value("output"), chdir=chdir, comment=value("comment"),
        sbatch_passthrough=passthrough,
    )
    if script is not None:
        return replace(spec, shebang=script.shebang, body=script.body, script_args=request.script_args)
    return replace(spec, command=request.command)


# --- rendering (pure) ---------------------------------------------------------


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def describe_layout(spec: JobSpec) -> str:
    """``2 nodes + 1 hot spare`` (with ranks per node when more than one)."""
    text = f"{_plural(spec.nodes, 'node')} + {_plural(spec.spares, 'hot spare')}"
    if spec.ntasks_per_node > 1:
        text += f", {spec.ntasks_per_node} tasks per node"
    return text


def render_batch_script(spec: JobSpec) -> str:
    """The batch script tp-submit hands to sbatch on stdin. Pure: same spec, same text."""
    q = shlex.quote
    lines = [
        spec.shebang,
        f"# Rendered by tp-submit from {spec.source}: {describe_layout(spec)}.",
        f"# sbatch gets its options on its command line (--nodes={spec.total_nodes} --no-kill ...).",
        f"export {ENV_NODES}={spec.nodes}",
        f"export {ENV_SPARES}={spec.spares}",
        f"export {ENV_NTASKS_PER_NODE}={spec.ntasks_per_node}",
        f"export {ENV_RUN_DIR}={q(spec.run_dir)}",
        f"export {ENV_SECRET_FILE}={q(spec.secret_file)}",
    ]
    if spec.command:
        lines.append("exec tp run -- " + " ".join(q(word) for word in spec.command))
        return "\n".join(lines) + "\n"
    if spec.script_args:
        lines.append("set -- " + " ".join(q(arg) for arg in spec.script_args))
    lines.append(f"# ---- {spec.source}, without its #! line; its #SBATCH lines are inert here ----")
    body = spec.body if spec.body.endswith("\n") or not spec.body else spec.body + "\n"
    return "\n".join(lines) + "\n" + body


def run_dir_comment(run_dir: str) -> str:
    """The job comment that names the run dir: ``torchpass:run_dir=/shared/runs/r1``."""
    return RUN_DIR_COMMENT_PREFIX + run_dir


def sbatch_arguments(spec: JobSpec) -> tuple[str, ...]:
    """sbatch's options for this job (without ``--parsable``, which the Submitter adds)."""
    args = [
        f"--job-name={spec.job_name}",
        f"--nodes={spec.total_nodes}",
        f"--ntasks-per-node={spec.ntasks_per_node}",
        "--no-kill",
        f"--output={spec.output or os.path.join(spec.run_dir, 'slurm-%j.out')}",
        f"--comment={run_dir_comment(spec.run_dir) if spec.comment is None else spec.comment}",
    ]
    if spec.partition:
        args.append(f"--partition={spec.partition}")
    if spec.chdir:
        args.append(f"--chdir={spec.chdir}")
    return (*args, *spec.sbatch_passthrough)


def sbatch_command_line(spec: JobSpec) -> str:
    """The exact command a Submitter runs, shell-quoted (the script goes to its stdin)."""
    return shlex.join(["sbatch", "--parsable", *sbatch_arguments(spec)])


# --- checks that look at this node (refuse before anything is submitted) -------


def read_batch_script(path: str, cwd: str) -> BatchScript:
    """Read and parse the user's script; a missing or unreadable one is a SubmitError."""
    full = _absolute(path, cwd)
    try:
        text = Path(full).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SubmitError(
            f"the batch script {path} does not exist (looked for {full})",
            hint="to run a program without a script: tp-submit [OPTIONS] -- COMMAND...",
        ) from None
    except IsADirectoryError:
        raise SubmitError(f"the batch script {path} is a directory, not a file") from None
    except PermissionError:
        raise SubmitError(f"the batch script {path} is not readable (permission denied)") from None
    except UnicodeDecodeError:
        raise SubmitError(f"the batch script {path} is not UTF-8 text") from None
    return parse_batch_script(text, path)


def _find_program(program: str, search_path: str | None) -> str | None:
    if "/" in program:
        return program if os.path.isfile(program) and os.access(program, os.X_OK) else None
    return shutil.which(program, path=search_path)


def check_script_interpreter(script: BatchScript, *, search_path: str | None = None) -> None:
    """The ``#!`` interpreter exists on this node and is a POSIX shell."""
    words = script.shebang[2:].split()
    if not words:
        raise SubmitError(f"the #! line of {script.source} names no interpreter",
                          hint="make it e.g. #!/bin/bash")
    interpreter, program = words[0], words[0]
    if os.path.basename(interpreter) == "env":
        rest = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
        program = rest[0] if rest else ""
    found = _find_program(interpreter, search_path) and _find_program(program, search_path)
    if not found:
        raise SubmitError(
            f"the interpreter of {script.source} ({script.shebang}) was not found on this node",
            hint="fix its #! line, e.g. #!/bin/bash",
        )
    name = os.path.basename(program)
    if name not in POSIX_SHELLS:
        raise SubmitError(
            f"{script.source} is run by {name} ({script.shebang}), not by a shell; tp-submit "
            "puts `export` lines in front of it, so it must be a shell script",
            hint=f"call it from a bash script with `tp run {name} ...`, "
            f"or use tp-submit [OPTIONS] -- {name} ...",
        )


def check_command(command: Sequence[str], workdir: str, *, search_path: str | None = None) -> None:
    """Command mode: the program exists here, on PATH or as a path (relative to ``workdir``).

    The job starts with this shell's environment (sbatch's default --export=ALL),
    so a program that is not found here is almost always a typo or a module not
    loaded. A program that really exists only on the compute nodes can be
    started from a batch script (``tp run COMMAND``), which is not checked.
    """
    program = command[0]
    if "/" in program:
        full = _absolute(program, workdir)
        if not os.path.isfile(full):
            raise SubmitError(f"the command {program} does not exist (looked for {full})")
        if not os.access(full, os.X_OK):
            raise SubmitError(f"the command {program} is not executable ({full})",
                              hint=f"chmod +x {shlex.quote(program)}")
        return
    if shutil.which(program, path=search_path) is None:
        raise SubmitError(
            f"the command {program!r} was not found on this node's PATH",
            hint="check the spelling, or load its module before tp-submit (the job starts with "
            "this environment); a program that exists only on the compute nodes can be started "
            "from a batch script with `tp run COMMAND`, which tp-submit does not check",
        )


def check_run_dir(run_dir: str) -> None:
    """The run dir is new or empty: one run dir, one run."""
    try:
        taken = any(os.scandir(run_dir))
    except FileNotFoundError:
        return
    except NotADirectoryError:
        raise SubmitError(f"the run dir {run_dir} exists and is not a directory") from None
    except PermissionError:
        raise SubmitError(f"the run dir {run_dir} is not readable (permission denied)") from None
    if taken:
        raise SubmitError(f"the run dir {run_dir} already exists and is not empty",
                          hint="each job needs its own run dir: pick another --run-dir")


def check_partition_fits(spec: JobSpec, partition: str | None, node_count: int | None) -> None:
    """N+S nodes fit into the partition (``node_count`` None: Slurm could not tell).

    Without a partition, ``node_count`` is the whole cluster's: a bound on the default one.
    """
    if node_count is None or spec.total_nodes <= node_count:
        return
    where = f"partition {partition!r}" if partition else "the cluster"
    raise SubmitError(
        f"the job needs {spec.total_nodes} nodes ({spec.nodes} active + "
        f"{_plural(spec.spares, 'hot spare')}), but {where} has only {_plural(node_count, 'node')}",
        hint="lower --spares or -N, or pick a larger partition with -p",
    )


# --- submitting ---------------------------------------------------------------


class Submitter(Protocol):
    """The two things tp-submit asks of Slurm."""

    def submit_batch(self, script: str, sbatch_args: Sequence[str]) -> str:
        """Run ``sbatch --parsable ARGS`` with ``script`` on stdin; return the job id."""
        ...

    def partition_node_count(self, partition: str | None) -> int | None:
        """Nodes in ``partition`` (None: in the cluster), or None if Slurm cannot tell."""
        ...


@dataclass(frozen=True)
class SubmitResult:
    job_id: str
    #: The spec as submitted (run dir and secret file as created).
    spec: JobSpec


def _claim_run_dir(run_dir: str, *, rename_if_taken: bool) -> tuple[str, bool]:
    """Create the run dir (or take an empty one); returns it and whether it was created."""
    candidates = [run_dir] + ([f"{run_dir}-{i}" for i in range(2, 100)] if rename_if_taken else [])
    for candidate in candidates:
        try:
            os.makedirs(candidate)
            return candidate, True
        except FileExistsError:
            if not rename_if_taken:
                check_run_dir(candidate)
                return candidate, False
        except OSError as exc:
            raise SubmitError(f"cannot create the run dir {candidate}: {exc.strerror}") from None
    raise SubmitError(f"{run_dir} and {len(candidates) - 1} numbered variants are all taken",
                      hint="pick a run dir with --run-dir")


def submit(
    spec: JobSpec,
    submitter: Submitter,
    create_secret: Callable[[Path], Path],
    *,
    rename_if_taken: bool = False,
) -> SubmitResult:
    """Create the run dir and the secret, then hand the rendered script to sbatch.

    With ``rename_if_taken`` (the default run dir) a taken name gets ``-2``,
    ``-3``... appended. If sbatch fails, the secret and a run dir created here
    are removed again and sbatch's error is raised unchanged.
    """
    run_dir, created = _claim_run_dir(spec.run_dir, rename_if_taken=rename_if_taken)
    secret: Path | None = None
    try:
        secret = create_secret(Path(run_dir))
        spec = replace(spec, run_dir=run_dir, secret_file=str(secret))
        job_id = submitter.submit_batch(render_batch_script(spec), sbatch_arguments(spec))
    except BaseException:
        if secret is not None:
            secret.unlink(missing_ok=True)
            _remove_empty(secret.parent)
        if created:
            _remove_empty(Path(run_dir))
        raise
    return SubmitResult(job_id.strip(), spec)


def _remove_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass
