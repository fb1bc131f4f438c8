"""The batch script and the sbatch command line for a JobSpec (pure; golden-file tested).

tp-submit asks sbatch for ``--nodes=N+S --ntasks-per-node=k --no-kill`` and
passes every option on sbatch's command line; the rendered script goes to
sbatch's stdin. Its header exports the TORCHPASS_* variables of
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
    ENV_SPARES,
)
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

#: The job comment tp-submit sets (unless the user gives ``--comment``), so that
#: ``tp status JOBID`` can find the run dir from Slurm alone.
RUN_DIR_COMMENT_PREFIX = "torchpass:run_dir="


def plural(n: int, word: str) -> str:
    """``1 node``, ``2 nodes``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def describe_layout(spec: JobSpec) -> str:
    """``2 nodes + 1 hot spare`` (with ranks per node when more than one)."""
    text = f"{plural(spec.nodes, 'node')} + {plural(spec.spares, 'hot spare')}"
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
