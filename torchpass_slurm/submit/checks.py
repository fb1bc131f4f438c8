"""What tp-submit looks at on this node, to refuse a job before anything is submitted.

The batch script must be readable and run by a POSIX shell found here, a
command must exist here, the run dir must be new or empty, and N+S nodes must
fit into the partition. Each check raises :class:`~torchpass_slurm.errors.SubmitError`
saying what it saw and what to do.
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
from collections.abc import Sequence
from pathlib import Path

from torchpass_slurm.errors import SubmitError
from torchpass_slurm.ownership import foreign, owner_name
from torchpass_slurm.submit.batch_script import BatchScript, parse_batch_script
from torchpass_slurm.submit.render import plural
from torchpass_slurm.submit.spec import JobSpec, absolute_path

__all__ = [
    "POSIX_SHELLS",
    "check_command",
    "check_partition_fits",
    "partition_unknown_warning",
    "check_run_dir",
    "check_run_dir_parents",
    "check_trusted_folder",
    "check_script_interpreter",
    "read_batch_script",
]

#: Interpreters the rendered script may keep: it starts with ``export`` lines.
POSIX_SHELLS = frozenset({"sh", "bash", "dash", "ksh", "mksh", "zsh", "ash", "busybox"})


def read_batch_script(path: str, cwd: str) -> BatchScript:
    """Read and parse the user's script; a missing or unreadable one is a SubmitError."""
    full = absolute_path(path, cwd)
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
        raise SubmitError(
            f"the #! line of {script.source} names no interpreter", hint="make it e.g. #!/bin/bash"
        )
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
        full = absolute_path(program, workdir)
        if not os.path.isfile(full):
            raise SubmitError(f"the command {program} does not exist (looked for {full})")
        if not os.access(full, os.X_OK):
            raise SubmitError(
                f"the command {program} is not executable ({full})", hint=f"chmod +x {shlex.quote(program)}"
            )
        return
    if shutil.which(program, path=search_path) is None:
        raise SubmitError(
            f"the command {program!r} was not found on this node's PATH",
            hint="check the spelling, or load its module before tp-submit (the job starts with "
            "this environment); a program that exists only on the compute nodes can be started "
            "from a batch script with `tp run COMMAND`, which tp-submit does not check",
        )


def check_run_dir(run_dir: str) -> None:
    """The run dir is new or empty, and nobody but its owner (or root) can change it or a
    folder above it: one run dir, one run, and no one else's files in it.

    Whoever can rename entries in a folder above ``checkpoints/`` can swap in a file the job
    then loads as its owner, so every existing folder on the way up is checked
    (:func:`check_trusted_folder`). The run dir itself, when it exists, must be empty and its
    owner's.
    """
    check_run_dir_parents(run_dir)
    try:
        taken = any(os.scandir(run_dir))
    except FileNotFoundError:
        return
    except NotADirectoryError:
        raise SubmitError(f"the run dir {run_dir} exists and is not a directory") from None
    except PermissionError:
        raise SubmitError(f"the run dir {run_dir} is not readable (permission denied)") from None
    if taken:
        raise SubmitError(
            f"the run dir {run_dir} already exists and is not empty",
            hint="each job needs its own run dir: pick another --run-dir",
        )
    check_trusted_folder(run_dir, "the run dir")


def check_run_dir_parents(run_dir: str) -> None:
    """Every existing folder above ``run_dir`` passes :func:`check_trusted_folder`."""
    path = Path(os.path.abspath(run_dir)).parent
    for folder in (path, *path.parents):
        if folder.exists():
            check_trusted_folder(str(folder), "the folder")


def check_trusted_folder(folder: str, what: str) -> None:
    """SubmitError unless ``folder`` is owned by this user or root and no other user can rename
    its entries: not writable by others unless sticky (``/tmp``), not writable by its group
    unless that group is this user's own primary group."""
    try:
        st = os.stat(folder)
    except OSError as exc:
        raise SubmitError(f"cannot look at {what} {folder}: {exc.strerror}") from None
    found = foreign(st, above=True)
    if found is None:
        return
    if found.owner is not None:
        raise SubmitError(
            f"{what} {folder} belongs to {owner_name(found.owner)}, not to you "
            f"({owner_name(os.geteuid())}) or root: its owner could replace the job's files",
            hint="put the run dir under a folder of your own (--run-dir)",
        )
    others = "others" in (found.writers or "")
    who = "every user" if others else f"the members of group {st.st_gid}"
    raise SubmitError(
        f"{what} {folder} is {stat.filemode(st.st_mode)}: {who} can rename its entries "
        "and replace the job's files",
        hint=f"chmod {'o' if others else 'g'}-w {folder}, or pick another --run-dir",
    )


def check_partition_fits(spec: JobSpec, partition: str | None, node_count: int | None) -> None:
    """N+S nodes fit into the partition (``node_count`` None: Slurm could not tell).

    Without a partition, ``node_count`` is the whole cluster's: a bound on the default one.
    """
    if node_count is None or spec.total_nodes <= node_count:
        return
    where = f"partition {partition!r}" if partition else "the cluster"
    raise SubmitError(
        f"the job needs {spec.total_nodes} nodes ({spec.nodes} active + "
        f"{plural(spec.spares, 'hot spare')}), but {where} has only {plural(node_count, 'node')}",
        hint="lower --spares or -N, or pick a larger partition with -p",
    )


def partition_unknown_warning(spec: JobSpec, partition: str | None, why: str | None = None) -> str:
    """The warning when the partition's size could not be read: what was not checked, and why."""
    where = f"partition {partition!r}" if partition else "the cluster"
    why = why or f"Slurm lists no nodes in {where}"
    return (
        f"warning: could not check the partition's size: {why}; not checked that the job's "
        f"{spec.total_nodes} nodes ({spec.nodes} active + {plural(spec.spares, 'hot spare')}) fit "
        f"(a job larger than its partition is never started)"
    )
