"""What the torch in use offers NCCL's in-process recovery, and what it must be given: the
capabilities (:func:`nccl_capabilities`), a non-blocking communicator's options
(:func:`nccl_options`), the settings that defeat recovery (:func:`recovery_env_problems`).
Re-exported by ``rank/backends.py``, the seam (its docstring states the API)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torchpass_slurm.config import NCCL_RECOVERY_ENV
from torchpass_slurm.errors import ConfigError

__all__ = [
    "SHRINK_MIN_NCCL",
    "NcclCapabilities",
    "nccl_capabilities",
    "nccl_options",
    "recovery_env_problems",
]

#: The first NCCL with ncclCommShrink (what torch's ``shrink_group`` calls).
SHRINK_MIN_NCCL = (2, 27, 3)


@dataclass(frozen=True)
class NcclCapabilities:
    """What the torch in use offers for NCCL's recovery (:func:`nccl_capabilities`)."""

    nccl_version: tuple[int, ...] | None
    group_abort: bool  # distributed_c10d._abort_process_group
    shrink: bool  # torch's shrink_group and an NCCL that has ncclCommShrink


def nccl_capabilities() -> NcclCapabilities:
    """What this torch offers: its NCCL's version (None without NCCL), torch's group abort, shrink."""
    import torch
    from torch.distributed import distributed_c10d

    version: tuple[int, ...] | None = None
    try:
        raw = torch.cuda.nccl.version()
        version = tuple(raw) if isinstance(raw, tuple) else (int(raw),)
    except (AttributeError, RuntimeError, TypeError):  # a CPU build: torch._C has no _nccl_version
        version = None
    shrink = callable(getattr(distributed_c10d, "shrink_group", None))
    return NcclCapabilities(
        nccl_version=version,
        group_abort=callable(getattr(distributed_c10d, "_abort_process_group", None)),
        shrink=shrink and version is not None and version >= SHRINK_MIN_NCCL,
    )


def nccl_options() -> Any:
    """``ProcessGroupNCCL.Options`` for a non-blocking communicator (``config.blocking = 0``):
    NCCL's calls return at once, so an abort reaches the communicator at any point."""
    import torch.distributed as dist

    pg_nccl = getattr(dist, "ProcessGroupNCCL", None)
    if pg_nccl is None or not dist.is_nccl_available():
        raise ConfigError(
            "this torch has no NCCL (a CPU build?): a NCCL process group cannot be made",
            hint="install a CUDA build of torch, or train with backend='gloo'",
        )
    options = pg_nccl.Options()
    options.config.blocking = 0
    return options


def recovery_env_problems(environ: Mapping[str, str]) -> list[str]:
    """``NAME=value (want V)`` for each setting of :data:`~torchpass_slurm.config.NCCL_RECOVERY_ENV`
    that ``environ`` gives another value: one that lets a watchdog end a survivor, or a
    communicator that cannot be aborted. Unset is no problem here (torch's default is then used:
    tp run sets them all)."""
    return [
        f"{name}={environ[name]} (want {value})"
        for name, (value, _) in NCCL_RECOVERY_ENV.items()
        if name in environ and environ[name] != value
    ]
