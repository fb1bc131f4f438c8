"""Submitting a JobSpec: claim the run dir, create the secret, hand the script to sbatch.

The only part of tp-submit with side effects on the shared file system and on
Slurm; both come in as arguments (a :class:`Submitter`, ``create_secret``),
so that tests run it against fakes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from torchpass_slurm.errors import SubmitError
from torchpass_slurm.submit.checks import check_run_dir, check_run_dir_parents
from torchpass_slurm.submit.render import render_batch_script, sbatch_arguments
from torchpass_slurm.submit.spec import JobSpec

__all__ = ["SubmitResult", "Submitter", "submit"]


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
    check_run_dir_parents(run_dir)
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
    raise SubmitError(
        f"{run_dir} and {len(candidates) - 1} numbered variants are all taken",
        hint="pick a run dir with --run-dir",
    )


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
    except BaseException:  # any failure, Ctrl-C included: remove what was created here, then re-raise
        if secret is not None:
            secret.unlink(missing_ok=True)
            _remove_empty(secret.parent)
        if created:
            _remove_empty(Path(run_dir))
        raise
    return SubmitResult(job_id.strip(), spec)


def _remove_empty(folder: Path) -> None:
    with contextlib.suppress(OSError):
        folder.rmdir()
