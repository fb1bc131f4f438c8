"""Atomic, rotating checkpoints on torch.distributed.checkpoint (DCP).

The fallback when live migration cannot help (no spare left, the batch host
died): the job restarts and resumes from the newest complete checkpoint.

What is stored is whatever the training passes in ``state``: a dict whose
values follow the ``state_dict`` protocol (DCP's ``Stateful``: an object with
``state_dict()`` and ``load_state_dict(sd)``), or are tensors / nested dicts of
tensors. A complete training state is: model, optimizer (and LR scheduler), the
RNG states (torch, numpy, python ``random``), the data position and the step.
:class:`TrainState` and :class:`RNGState` cover model, optimizer and RNG; the
data position is the training's own (``tiny_gpt.py`` derives it from the step).

Layout on disk (``directory`` must be on a file system that every rank sees)::

    directory/
      step-00000040/          complete checkpoints (DCP: .metadata + __<rank>_0.distcp)
      step-00000050/
      latest                  "step-00000050\\n", replaced atomically
      .tmp-step-00000060/     a save in progress (or torn by a crash): ignored

A save writes into ``.tmp-step-<N>``; after every rank has written (a barrier),
rank 0 renames it to ``step-<N>``, replaces ``latest``, and deletes all but
the newest ``keep`` checkpoints. A crash at any point leaves the previous
checkpoint intact and readable.

Works in a single process (no process group) and under any initialized
process group (gloo on CPU, NCCL on GPU). torch is imported lazily.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torchpass_slurm.errors import CheckpointError
from torchpass_slurm.rank.trusted_dir import check_trusted, make_private, opened_tree

__all__ = ["save", "load_latest", "latest_step", "TrainState", "RNGState", "step_dir"]

logger = logging.getLogger(__name__)

LATEST = "latest"
_STEP_RE = re.compile(r"^step-(\d+)$")
_TMP_PREFIX = ".tmp-"
_STEP_KEY = "torchpass_step"
# _DCP_ERRORS: what torch.distributed.checkpoint raises, besides its CheckpointException (which
# gathers the ranks' errors), for a state that does not fit the stored one or a collective that
# failed: torch's RuntimeError (DistError too), and ValueError / KeyError / TypeError from its
# planners. Both save and load turn exactly these into a CheckpointError.


def step_dir(directory: str | os.PathLike[str], step: int) -> Path:
    """The folder of the checkpoint of ``step`` (it may not exist)."""
    return Path(directory) / f"step-{step:08d}"


# --- state adapters (DCP Stateful) ---------------------------------------------


class TrainState:
    """Model + optimizer (+ optional LR scheduler) as one DCP ``Stateful``.

    Uses ``torch.distributed.checkpoint.state_dict``, so parameter names are
    FQNs (no ``module.`` prefix from DDP; optimizer state keyed by FQN, not by
    parameter id), and the checkpoint loads into a model wrapped or not.
    """

    def __init__(self, model: Any, optimizer: Any, scheduler: Any | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer state in DCP's canonical form."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        sd: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        if self.scheduler is not None:
            sd["scheduler"] = self.scheduler.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore model and optimizer (and scheduler) in place."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state_dict["scheduler"])


class RNGState:
    """The RNG states of this rank (torch CPU, CUDA if used, numpy, python) as tensors.

    Each rank's states are stored under its own key (``rank<R>``): DCP treats
    equal keys on different ranks as replicas and would keep only one copy.
    Everything is a tensor, so nothing is pickled; numpy is optional.
    """

    def __init__(self, rank: int | None = None) -> None:
        self._rank = rank

    def _key(self) -> str:
        return f"rank{self._rank if self._rank is not None else _dist_rank()}"

    def state_dict(self) -> dict[str, Any]:
        """This rank's RNG states, as tensors."""
        import torch

        sd: dict[str, Any] = {"torch": torch.get_rng_state(), "python": _python_rng_to_tensor()}
        np_state = _numpy_rng_to_tensor()
        if np_state is not None:
            sd["numpy"] = np_state
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            sd["cuda"] = torch.cuda.get_rng_state()
        return {self._key(): sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore this rank's RNG states."""
        import torch

        key = self._key()
        if key not in state_dict:
            raise CheckpointError(
                f"the checkpoint has no RNG state for {key} (it has {sorted(state_dict)})",
                hint="resume with the same world size the checkpoint was written with",
            )
        sd = state_dict[key]
        torch.set_rng_state(sd["torch"])
        _python_rng_from_tensor(sd["python"])
        if "numpy" in sd:
            _numpy_rng_from_tensor(sd["numpy"])
        if "cuda" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state(sd["cuda"])


def _python_rng_to_tensor() -> Any:
    import torch

    version, internal, gauss = random.getstate()
    head = [version, 0 if gauss is None else 1]
    gauss_bits = torch.tensor([0.0 if gauss is None else gauss], dtype=torch.float64).view(torch.int64)
    return torch.cat([torch.tensor(head + list(internal), dtype=torch.int64), gauss_bits])


def _python_rng_from_tensor(t: Any) -> None:
    import torch

    values = t.tolist()
    version, has_gauss = values[0], values[1]
    internal = tuple(values[2:-1])
    gauss = torch.tensor(values[-1:], dtype=torch.int64).view(torch.float64).item() if has_gauss else None
    random.setstate((version, internal, gauss))


def _numpy_rng_to_tensor() -> Any | None:
    try:
        import numpy as np
    except ImportError:
        return None
    import torch

    state = np.random.get_state()  # a tuple for the legacy MT19937 generator, else a dict
    if not isinstance(state, tuple) or state[0] != "MT19937":  # pragma: no cover - it is always MT19937
        return None
    _, keys, pos, has_gauss, cached = state
    cached_bits = np.array([cached], dtype=np.float64).view(np.int64)
    return torch.tensor(np.concatenate([keys.astype(np.int64), [pos, has_gauss], cached_bits]))


def _numpy_rng_from_tensor(t: Any) -> None:
    try:
        import numpy as np
    except ImportError:
        logger.warning("the checkpoint holds a numpy RNG state but numpy is not installed; not restored")
        return
    values = t.numpy().astype(np.int64)
    keys = values[:624].astype(np.uint32)
    pos, has_gauss = int(values[624]), int(values[625])
    cached = float(values[626:627].view(np.float64)[0])
    np.random.set_state(("MT19937", keys, pos, has_gauss, cached))


# --- process-group helpers -----------------------------------------------------


def _dist_active() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return False
    return dist.is_available() and dist.is_initialized()


def _dist_rank() -> int:
    if _dist_active():
        import torch.distributed as dist

        return dist.get_rank()
    return 0


def _no_dist_kwargs(fn: Any) -> dict[str, bool]:
    """``no_dist=True`` without a process group, where this torch's DCP accepts it.

    Older DCP versions detect the single-process case themselves (with a warning).
    """
    import inspect

    if _dist_active() or "no_dist" not in inspect.signature(fn).parameters:
        return {}
    return {"no_dist": True}


def _require_numpy_if_distributed() -> None:
    """DCP exchanges its plans with ``gather_object``, which needs numpy: say so up front."""
    if not _dist_active():
        return
    try:
        import numpy  # noqa: F401
    except ImportError:
        raise CheckpointError(
            "a checkpoint under a process group needs numpy (torch.distributed's "
            "object collectives use it), and numpy is not installed",
            hint="pip install numpy (Debian: apt install python3-numpy)",
        ) from None


def _barrier() -> None:
    if _dist_active():
        import torch.distributed as dist

        dist.barrier()


def _broadcast_int(value: int) -> int:
    """Rank 0's ``value`` on every rank (identity without a process group)."""
    if not _dist_active():
        return value
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    dist.broadcast(t, src=0)
    return int(t.item())


# --- finding checkpoints -------------------------------------------------------


#: The file a complete DCP checkpoint folder holds (written last by ``dcp.save``).
DCP_MARKER = ".metadata"


def _complete_steps(directory: Path, marker: str = DCP_MARKER) -> list[int]:
    """Steps of the complete checkpoints in ``directory`` (a folder with ``marker``), oldest first."""
    if not directory.is_dir():
        return []
    steps = []
    for entry in directory.iterdir():
        m = _STEP_RE.match(entry.name)
        if m and (entry / marker).is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def latest_step(directory: str | os.PathLike[str]) -> int | None:
    """The step of the newest complete checkpoint in ``directory``, or None.

    The ``latest`` pointer is preferred; if it is missing or points at a
    checkpoint that is gone, the newest complete ``step-<N>`` folder is used.
    Folders of interrupted saves (``.tmp-*``) are never considered.
    """
    return newest_step(Path(directory), DCP_MARKER)


def newest_step(directory: Path, marker: str) -> int | None:
    """:func:`latest_step` for checkpoints that are complete once they hold ``marker``."""
    steps = _complete_steps(directory, marker)
    pointer = directory / LATEST
    if pointer.is_file():
        m = _STEP_RE.match(pointer.read_text().strip())
        if m and int(m.group(1)) in steps:
            return int(m.group(1))
        logger.warning(
            "%s points at %r, which is not a complete checkpoint; using the newest folder",
            pointer,
            pointer.read_text().strip(),
        )
    return steps[-1] if steps else None


# --- save ------------------------------------------------------------------------


def save(state: Mapping[str, Any], directory: str | os.PathLike[str], step: int, *, keep: int = 3) -> Path:
    """Write ``state`` as the checkpoint of ``step``; collective if a process group exists.

    Every rank must call it with the same ``directory`` and ``step``. Returns
    the final folder ``directory/step-<N>``. Keeps the newest ``keep``
    checkpoints and deletes older ones. Raises :class:`CheckpointError` if the
    folder cannot be written.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    _require_numpy_if_distributed()
    payload = dict(state)
    payload[_STEP_KEY] = _step_tensor(step)

    def write(tmp: Path, rank: int) -> None:
        try:
            dcp.save(payload, checkpoint_id=str(tmp), **_no_dist_kwargs(dcp.save))
        except OSError as exc:
            raise CheckpointError(
                f"saving the checkpoint of step {step} into {tmp} failed: {exc}",
                hint="check that the folder is on a shared, writable file system with free space",
            ) from exc
        except (CheckpointException, RuntimeError, ValueError, KeyError, TypeError) as exc:  # _DCP_ERRORS
            raise CheckpointError(
                f"saving the checkpoint of step {step} into {tmp} failed: {_reason(exc)}",
                hint="if another rank failed first, its log has the cause",
            ) from exc

    final = staged_save(Path(directory), step, keep, write, marker=DCP_MARKER)
    logger.info("checkpoint of step %d written to %s", step, final)
    return final


def staged_save(
    directory: Path,
    step: int,
    keep: int,
    write: Callable[[Path, int], None],
    *,
    marker: str,
    make_folder: bool = False,
    seal: Callable[[Path], None] | None = None,
) -> Path:
    """The save both checkpoint formats share (every rank calls it): rank 0 prepares a private
    ``.tmp-step-<N>`` folder (made here with ``make_folder``); each rank writes its part into it
    (``write(tmp, rank)``); rank 0 seals it (``seal(tmp)``, which writes ``marker`` where the
    writers do not), renames it to ``step-<N>``, points ``latest`` at it and keeps the newest
    ``keep`` complete ones. Barriers between the phases. The final folder."""
    if keep < 1:
        raise CheckpointError(f"keep={keep} would delete the checkpoint just written", hint="use keep >= 1")
    final = step_dir(directory, step)
    tmp = directory / f"{_TMP_PREFIX}{final.name}"
    rank = _dist_rank()
    if rank == 0:
        _prepare(directory, tmp)
        if make_folder:
            tmp.mkdir()
    _barrier()
    write(tmp, rank)
    _barrier()
    if rank == 0:
        if seal is not None:
            seal(tmp)
        _publish(directory, tmp, final)
        _prune(directory, keep, marker)
    _barrier()
    return final


def _reason(exc: BaseException) -> str:
    """The last line of an error: DCP wraps each rank's traceback into its message."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1][:300] if lines else type(exc).__name__


def _step_tensor(step: int) -> Any:
    import torch

    return torch.tensor([step], dtype=torch.int64)


def _prepare(directory: Path, tmp: Path) -> None:
    """Create the folder private (no group/other write), or check that an existing one is."""
    existed = directory.is_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if not existed:
            make_private(directory)
        if tmp.exists():
            logger.warning("removing %s, left by an interrupted save", tmp)
            shutil.rmtree(tmp)
    except OSError as exc:
        raise CheckpointError(f"cannot prepare the checkpoint folder {directory}: {exc}") from exc
    if existed:  # fail at the first save, not at the restart that needs the checkpoint
        check_trusted(directory)


def _publish(directory: Path, tmp: Path, final: Path) -> None:
    """Rename the finished save into place and point ``latest`` at it, atomically."""
    try:
        make_private(tmp)  # a umask of 002 would leave files that load_latest refuses
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer_tmp = directory / f"{_TMP_PREFIX}{LATEST}"
        with open(pointer_tmp, "w") as f:
            f.write(final.name + "\n")
            f.flush()
            os.fsync(f.fileno())
        make_private(pointer_tmp)
        os.replace(pointer_tmp, directory / LATEST)
    except OSError as exc:
        raise CheckpointError(
            f"cannot publish checkpoint {final}: {exc}",
            hint=f"the data is in {tmp}; check permissions of {directory}",
        ) from exc


def _prune(directory: Path, keep: int, marker: str) -> None:
    for old in _complete_steps(directory, marker)[:-keep]:
        shutil.rmtree(step_dir(directory, old), ignore_errors=True)
        logger.debug("deleted old checkpoint of step %d", old)


# --- load ------------------------------------------------------------------------


def load_latest(state: dict[str, Any], directory: str | os.PathLike[str]) -> int | None:
    """Load the newest complete checkpoint into ``state`` in place; return its step.

    Returns None (and leaves ``state`` untouched) if ``directory`` holds no
    complete checkpoint. Under a process group, rank 0 chooses the step and
    every rank loads that one. Raises :class:`CheckpointError` if the
    checkpoint exists but cannot be read into ``state``, or if the folder or
    anything in the checkpoint is owned by another user or writable by group
    or others (DCP unpickles the metadata: see :mod:`.trusted_dir`).
    """
    directory = Path(directory)
    found = latest_step(directory) if _dist_rank() == 0 else None
    step = _broadcast_int(-1 if found is None else found)
    if step < 0:
        logger.info("no checkpoint in %s: starting from scratch", directory)
        return None
    path = step_dir(directory, step)
    _require_numpy_if_distributed()
    import torch.distributed.checkpoint as dcp

    payload = dict(state)
    payload[_STEP_KEY] = _step_tensor(-1)
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    # every rank checks (each one unpickles the metadata), and loads what it checked
    with opened_tree(directory, path.name) as checked:
        try:
            dcp.load(payload, checkpoint_id=str(checked), **_no_dist_kwargs(dcp.load))
        except (CheckpointException, RuntimeError, ValueError, KeyError, TypeError) as exc:  # _DCP_ERRORS
            raise CheckpointError(
                f"loading the checkpoint {path} failed: {_reason(exc)}",
                hint="the state passed in must have the same keys and shapes as when it was saved",
            ) from exc
    stored = int(payload[_STEP_KEY].item())
    if stored != step:
        raise CheckpointError(
            f"{path} holds step {stored}, its name says {step}",
            hint="the folder was renamed or mixed up by hand; delete it",
        )
    for key, value in payload.items():  # plain (non-Stateful) values are replaced by DCP
        if key in state and not hasattr(value, "load_state_dict"):
            state[key] = value
    logger.info("resumed from checkpoint %s", path)
    return step
