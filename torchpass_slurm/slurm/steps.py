"""Build the ``srun`` command line of one job step on one node (pure).

torchpass runs one step per node so that a node's death takes only its own
step. Each step therefore gets ``--no-kill`` (keep the job when a node
fails) as a command-line FLAG: on Slurm 24.11 the environment variable
``SLURM_NO_KILL=1`` makes srun fail with "Invalid --no-kill specification",
so :func:`step_env` also removes it from the step's environment.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["StepRequest", "srun_argv", "step_env", "EXPANDED_NODE_UNSET"]

#: Environment variables that must not reach srun (see the module docstring).
UNSAFE_STEP_ENV = ("SLURM_NO_KILL",)
#: Not for a step on a node merged into the job by expansion (a spare refill): with any
#: cpus-per-task request, from the batch script's environment or the command line, such a
#: step stays pending for good ("Requested nodes are busy"; measured on Slurm 24.11). In a
#: heterogeneous job (``tp-submit --supervisor-partition``) their per-component copies
#: (``..._HET_GROUP_1``, and the older ``..._PACK_GROUP_1``) did the same: they go too.
EXPANDED_NODE_UNSET = ("SLURM_CPUS_PER_TASK", "SLURM_TRES_PER_TASK")
#: The suffixes of a heterogeneous job's per-component copies of a variable.
_COMPONENT_COPIES = ("_HET_GROUP_", "_PACK_GROUP_")


@dataclass(frozen=True)
class StepRequest:
    """One ``srun --no-kill`` step on one node: what :meth:`SlurmBackend.launch_step` starts.

    ``job_id`` targets a job from outside it (``--jobid``); inside the batch script leave it
    None. ``extra_args`` go before the command, unchanged. ``env`` is added to this process's
    environment; ``unset_env`` names variables of it the step must not inherit.
    """

    command: tuple[str, ...]
    node: str
    job_id: int | None = None
    ntasks: int = 1
    job_name: str | None = None
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] | None = None
    unset_env: tuple[str, ...] = ()


def srun_argv(step: StepRequest) -> list[str]:
    """``srun --no-kill --nodes=1 --ntasks=N --nodelist=NODE [...] COMMAND...``."""
    if not step.command:
        raise ValueError("srun_argv: the step needs a command")
    if step.ntasks < 1:
        raise ValueError(f"srun_argv: ntasks must be >= 1, got {step.ntasks}")
    if not step.node or "," in step.node or "[" in step.node:
        raise ValueError(f"srun_argv: one node name expected, got {step.node!r}")
    argv = ["srun", "--no-kill", "--nodes=1", f"--ntasks={step.ntasks}", f"--nodelist={step.node}"]
    if step.job_id is not None:
        argv.append(f"--jobid={step.job_id}")
    if step.job_name:
        argv.append(f"--job-name={step.job_name}")
    argv.extend(step.extra_args)
    argv.extend(step.command)
    return argv


def step_env(
    base: Mapping[str, str], extra: Mapping[str, str] | None = None, unset: Sequence[str] = ()
) -> dict[str, str]:
    """``base`` plus ``extra``, without the variables that break srun nor those in ``unset``
    (with their copies per heterogeneous job component)."""
    env = dict(base)
    env.update(extra or {})
    for key in (*UNSAFE_STEP_ENV, *unset):
        env.pop(key, None)
    copies = tuple(f"{key}{suffix}" for key in unset for suffix in _COMPONENT_COPIES)
    for key in [k for k in env if copies and k.startswith(copies)]:
        del env[key]
    return env
