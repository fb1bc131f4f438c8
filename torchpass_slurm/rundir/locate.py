"""Finding a job's run folder from what the user typed: a folder, or a Slurm job id.

``tp status`` and ``tp events`` accept either. A folder is used as it is if it
holds ``status.json`` or ``events.jsonl``. A number is a Slurm job id: Slurm is
asked for the job, and its run folder is read from the comment tp-submit gave
it (``--comment=torchpass:run_dir=PATH``); failing that, the folder of the
job's stdout file is used if it is a run folder (tp-submit's default
``--output`` is ``RUN_DIR/slurm-%j.out``).

``tp report`` also takes a folder of run folders (a fleet's, such as
``/shared/runs``): :func:`run_dirs_in` lists the run folders one level down.

Only :func:`find_run_dir` talks to Slurm, through an injected backend;
:func:`run_dir_of_job` is pure apart from looking at the file system.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from torchpass_slurm.errors import RunDirError
from torchpass_slurm.rundir.events import EVENTS_FILE
from torchpass_slurm.rundir.status import STATUS_FILE

if TYPE_CHECKING:
    from torchpass_slurm.slurm import Job, SlurmBackend

__all__ = [
    "RUN_DIR_COMMENT_PREFIX",
    "find_run_dir",
    "is_run_dir",
    "run_dir_from_comment",
    "run_dir_of_job",
    "run_dirs_in",
]

logger = logging.getLogger(__name__)

#: The job comment tp-submit sets (unless the user gives ``--comment``), so that
#: ``tp status JOBID`` can find the run dir from Slurm alone.
RUN_DIR_COMMENT_PREFIX = "torchpass:run_dir="

#: Files whose presence makes a folder a run folder.
RUN_DIR_MARKERS = (STATUS_FILE, EVENTS_FILE)


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` is a folder holding ``status.json`` or ``events.jsonl``."""
    return path.is_dir() and any((path / marker).is_file() for marker in RUN_DIR_MARKERS)


def run_dirs_in(folder: Path) -> list[Path]:
    """The run folders directly inside ``folder``, sorted by name; RunDirError if it holds none."""
    try:
        entries = sorted(folder.iterdir())
    except OSError as exc:
        raise RunDirError(f"cannot list the folder {folder}: {exc.strerror}") from None
    run_dirs = [entry for entry in entries if is_run_dir(entry)]
    if not run_dirs:
        raise RunDirError(
            f"{folder} is neither a torchpass run folder nor a folder of run folders: neither it nor "
            f"any folder in it has {STATUS_FILE} or {EVENTS_FILE}",
            hint="pass a job id, a run folder, or the folder that holds the run folders (e.g. /shared/runs)",
        )
    return run_dirs


def run_dir_from_comment(comment: str | None) -> Path | None:
    """The run folder named in a job comment (``torchpass:run_dir=PATH``), or None."""
    if not comment:
        return None
    at = comment.find(RUN_DIR_COMMENT_PREFIX)
    if at < 0:
        return None
    path = comment[at + len(RUN_DIR_COMMENT_PREFIX) :].strip()
    return Path(path) if path else None


def run_dir_of_job(job: Job) -> Path:
    """The run folder of a Slurm job: from its comment, else the folder of its stdout.

    A folder named in the comment is returned even before the supervisor has
    written anything there (a pending job), as long as it exists.
    """
    from_comment = run_dir_from_comment(job.comment)
    if from_comment is not None:
        if not from_comment.is_dir():
            raise RunDirError(
                f"job {job.job_id}'s comment names the run folder {from_comment}, which does not exist here",
                hint="run this on a host that mounts that file system, or pass the run folder instead",
            )
        return from_comment
    if job.std_out:
        beside_output = Path(job.std_out).parent
        if is_run_dir(beside_output):
            logger.debug("job %s: run folder %s found beside its stdout", job.job_id, beside_output)
            return beside_output
    raise RunDirError(
        f"job {job.job_id} was not submitted with tp-submit (no torchpass run dir in its comment); "
        "pass the run folder instead",
        hint=f"the run folder holds {STATUS_FILE} and {EVENTS_FILE}; tp-submit printed it when it submitted",
    )


def find_run_dir(job_or_path: str, backend: SlurmBackend | None = None) -> Path:
    """The run folder ``job_or_path`` names: a run folder itself, or a Slurm job id.

    ``backend`` is asked for the job (default: :func:`~torchpass_slurm.slurm.select_backend`).
    """
    if not job_or_path.strip():
        raise RunDirError(
            "no job id or run folder was given", hint="pass a job id (e.g. 4242) or the job's run folder"
        )
    path = Path(job_or_path).expanduser()
    if path.is_dir():
        if is_run_dir(path):
            return path
        raise RunDirError(
            f"{job_or_path} is a folder but not a torchpass run folder (it has no {STATUS_FILE} "
            f"and no {EVENTS_FILE})",
            hint="pass the run folder tp-submit printed, or the job id",
        )
    if not (job_or_path.isascii() and job_or_path.isdigit()):
        raise RunDirError(
            f"{job_or_path!r} is neither a folder nor a Slurm job id",
            hint="pass a job id (e.g. 4242) or the job's run folder",
        )
    if backend is None:
        from torchpass_slurm.slurm import select_backend

        backend = select_backend()
    return run_dir_of_job(backend.job(int(job_or_path)))
