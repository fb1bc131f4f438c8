"""The batch script and the sbatch command line for a JobSpec (pure; golden-file tested).

tp-submit asks sbatch for ``--nodes=N+S --ntasks-per-node=k --no-kill`` and
passes every option on sbatch's command line; the rendered script goes to
sbatch's stdin. With a supervisor partition the job is heterogeneous:
``sbatch [component 0: the supervisor] : [component 1: the N+S training nodes]``;
the options that belong to the whole job (time limit, account, mail, ...)
go to component 0, from which Slurm carries them over to component 1, and
every other option of the user (GPUs, memory, constraints) to component 1.
The script's header exports the TORCHPASS_* variables of
``docs/design/runtime-contract.md``; the script's own ``#SBATCH`` lines end up
after those ``export`` lines, where sbatch no longer reads them.
"""

from __future__ import annotations

import os
import shlex

from torchpass_slurm.config import (
    ENV_NODES,
    ENV_NTASKS_PER_NODE,
    ENV_RUN_DIR,
    ENV_SECRET_FILE,
    ENV_SPARE_WAIT,
    ENV_SPARES,
    ENV_TRAINING_HET_GROUP,
    ENV_TRANSPORT,
)
from torchpass_slurm.rundir.locate import RUN_DIR_COMMENT_PREFIX
from torchpass_slurm.submit.options import SBATCH_OPTIONS, parse_options
from torchpass_slurm.submit.spec import JobSpec

__all__ = [
    "RUN_DIR_COMMENT_PREFIX",
    "describe_layout",
    "plural",
    "render_batch_script",
    "run_dir_comment",
    "sbatch_arguments",
    "sbatch_command_line",
]


def plural(n: int, word: str) -> str:
    """``1 node``, ``2 nodes``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def describe_layout(spec: JobSpec) -> str:
    """``2 nodes + 1 hot spare`` (with ranks per node when more than one)."""
    text = f"{plural(spec.nodes, 'node')} + {plural(spec.spares, 'hot spare')}"
    if spec.ntasks_per_node > 1:
        text += f", {spec.ntasks_per_node} tasks per node"
    return text


#: sbatch options of the whole job: given to component 0 of a heterogeneous job, Slurm
#: carries them over to component 1 (measured for --time, --job-name, --comment).
JOB_WIDE = frozenset(
    [
        "account",
        "acctg-freq",
        "begin",
        "deadline",
        "dependency",
        "error",
        "export",
        "export-file",
        "hold",
        "kill-on-invalid-dep",
        "mail-type",
        "mail-user",
        "nice",
        "open-mode",
        "priority",
        "qos",
        "quiet",
        "requeue",
        "no-requeue",
        "signal",
        "test-only",
        "time",
        "time-min",
        "verbose",
        "wait",
        "wckey",
    ]
)
#: The het group of the training nodes (the supervisor is group 0).
TRAINING_HET_GROUP = 1


def _header(spec: JobSpec) -> list[str]:
    if spec.supervisor is None:
        return [f"# sbatch gets its options on its command line (--nodes={spec.total_nodes} --no-kill ...)."]
    return [
        f"# A heterogeneous job: component 0 ({spec.supervisor.partition}, 1 task) runs this script,",
        f"# the supervisor and the rendezvous store; component {TRAINING_HET_GROUP} holds the "
        f"{spec.total_nodes} training nodes",
        f"# (--nodes={spec.total_nodes} --no-kill ...). sbatch gets its options on its command line.",
        f"export {ENV_TRAINING_HET_GROUP}={TRAINING_HET_GROUP}",
    ]


def render_batch_script(spec: JobSpec) -> str:
    """The batch script tp-submit hands to sbatch on stdin. Pure: same spec, same text."""
    q = shlex.quote
    lines = [
        spec.shebang,
        f"# Rendered by tp-submit from {spec.source}: {describe_layout(spec)}.",
        *_header(spec),
        f"export {ENV_NODES}={spec.nodes}",
        f"export {ENV_SPARES}={spec.spares}",
        *([f"export {ENV_SPARE_WAIT}={spec.spare_wait:g}"] if spec.spare_wait is not None else []),
        *([f"export {ENV_TRANSPORT}={spec.transport}"] if spec.transport is not None else []),
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


def _comment_and_output(spec: JobSpec) -> list[str]:
    return [
        f"--output={spec.output or os.path.join(spec.run_dir, 'slurm-%j.out')}",
        f"--comment={run_dir_comment(spec.run_dir) if spec.comment is None else spec.comment}",
    ]


def _training_counts(spec: JobSpec) -> list[str]:
    return [f"--nodes={spec.total_nodes}", f"--ntasks-per-node={spec.ntasks_per_node}", "--no-kill"]


def _split_passthrough(words: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """The user's options for sbatch -> (the whole job's, the training component's), in order."""
    whole: list[str] = []
    training: list[str] = []
    options, _ = parse_options(list(words), SBATCH_OPTIONS, "sbatch")
    for option in options:
        (whole if option.name in JOB_WIDE else training).extend(option.tokens)
    return whole, training


def sbatch_arguments(spec: JobSpec) -> tuple[str, ...]:
    """sbatch's options for this job (without ``--parsable``, which the Submitter adds)."""
    partition = [f"--partition={spec.partition}"] if spec.partition else []
    chdir = [f"--chdir={spec.chdir}"] if spec.chdir else []
    if spec.supervisor is None:
        return (
            f"--job-name={spec.job_name}",
            *_training_counts(spec),
            *_comment_and_output(spec),
            *partition,
            *chdir,
            *spec.sbatch_passthrough,
        )
    whole, training = _split_passthrough(spec.sbatch_passthrough)
    return (
        f"--job-name={spec.job_name}",
        *_comment_and_output(spec),
        *chdir,
        *spec.supervisor.sbatch_options(),
        "--no-kill",
        *whole,
        ":",
        *_training_counts(spec),
        *partition,
        *training,
    )


def sbatch_command_line(spec: JobSpec) -> str:
    """The exact command a Submitter runs, shell-quoted (the script goes to its stdin)."""
    return shlex.join(["sbatch", "--parsable", *sbatch_arguments(spec)])
