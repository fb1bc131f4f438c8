"""The interface every Slurm backend offers, and the choice between backends.

:class:`SlurmBackend` is what the rest of torchpass calls. Two classes
implement it:

* :class:`~torchpass_slurm.slurm.cli_backend.CliSlurm` (default): Slurm's
  commands with JSON output; works with every Slurm from 22.05 on.
* :class:`~torchpass_slurm.slurm.pyslurm_backend.PyslurmSlurm`: used only when
  ``import pyslurm`` works AND pyslurm's major.minor equals the running
  Slurm's (pyslurm refuses other releases).

:data:`BACKEND_ENV` (``TORCHPASS_SLURM_BACKEND``) = ``auto`` (default), ``cli``
or ``pyslurm`` overrides the choice; ``pyslurm`` fails loudly when it cannot
be honoured.
"""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from types import ModuleType
from typing import Protocol, runtime_checkable

from torchpass_slurm.errors import ConfigError, SlurmError
from torchpass_slurm.slurm.cli_backend import CliSlurm
from torchpass_slurm.slurm.models import Job, Node, SlurmVersion
from torchpass_slurm.slurm.runner import Runner
from torchpass_slurm.slurm.steps import StepRequest

logger = logging.getLogger(__name__)

__all__ = ["SlurmBackend", "select_backend", "BACKEND_ENV", "pyslurm_matches"]

#: Environment variable: ``auto`` | ``cli`` | ``pyslurm``.
BACKEND_ENV = "TORCHPASS_SLURM_BACKEND"
_CHOICES = ("auto", "cli", "pyslurm")


@runtime_checkable
class SlurmBackend(Protocol):
    """Everything torchpass asks of Slurm. Errors are :class:`SlurmError` subclasses."""

    name: str

    def version(self) -> SlurmVersion: ...
    def ping(self) -> bool: ...
    def nodes(
        self, names: Iterable[str] | None = None, *, partition: str | None = None
    ) -> tuple[Node, ...]: ...
    def node(self, name: str) -> Node: ...
    def job(self, job_id: int) -> Job: ...
    def jobs(self, job_ids: Iterable[int] | None = None, *, user: str | None = None) -> tuple[Job, ...]: ...
    def submit_batch(
        self, script: str | os.PathLike[str], args: Sequence[str] = (), env: Mapping[str, str] | None = None
    ) -> int: ...
    def launch_step(self, step: StepRequest) -> subprocess.Popen[bytes]: ...
    def drain(self, node: str, reason: str) -> None: ...
    def resume(self, node: str) -> None: ...
    def shrink_job(self, job_id: int, keep_nodes: Iterable[str]) -> None: ...
    def cancel(self, job_id: int, *, signal: str | None = None) -> None: ...
    def expand_job(self, job_id: int, *, wait_s: int, exclude: Iterable[str] = ()) -> tuple[str, ...]: ...
    def cancel_expansion(self, job_id: int) -> None: ...
    def slurmd_started(self, names: Iterable[str]) -> dict[str, float]: ...
    def config_value(self, key: str) -> str | None: ...


def pyslurm_matches(pyslurm: ModuleType, slurm: SlurmVersion) -> bool:
    """True when pyslurm's ``__version__`` has the running Slurm's major.minor."""
    version = str(getattr(pyslurm, "__version__", ""))
    parts = version.split(".")
    if len(parts) < 2 or not (parts[0].isdigit() and parts[1].isdigit()):
        return False
    return (int(parts[0]), int(parts[1])) == (slurm.major, slurm.minor)


def _import_pyslurm() -> ModuleType | None:
    try:
        return importlib.import_module("pyslurm")
    # Deliberately broad: a compiled binding can fail at import in any way (ImportError,
    # OSError from libslurm, a check of its own that raises or even calls sys.exit());
    # every one of them means "use the CLI backend", never "stop tp".
    except (Exception, SystemExit) as err:
        logger.debug("pyslurm not usable: %s: %s", type(err).__name__, err)
        return None


def select_backend(runner: Runner | None = None, *, choice: str | None = None) -> SlurmBackend:
    """The backend to use here: ``choice`` > :data:`BACKEND_ENV` > ``auto``."""
    choice = (choice or os.environ.get(BACKEND_ENV) or "auto").strip().lower()
    if choice not in _CHOICES:
        raise ConfigError(
            f"{BACKEND_ENV}={choice!r} is not a backend",
            hint=f"valid values: {', '.join(_CHOICES)}.",
        )
    cli = CliSlurm(runner)
    if choice == "cli":
        return cli
    pyslurm = _import_pyslurm()
    if pyslurm is None:
        return _fallback(cli, choice, "pyslurm is not installed or does not load")
    slurm = cli.version()
    if not pyslurm_matches(pyslurm, slurm):
        reason = f"pyslurm {getattr(pyslurm, '__version__', '?')} does not match Slurm {slurm}"
        return _fallback(cli, choice, reason)
    from torchpass_slurm.slurm.pyslurm_backend import PyslurmSlurm

    logger.info("using the pyslurm backend (Slurm %s)", slurm)
    return PyslurmSlurm(pyslurm, runner)


def _fallback(cli: CliSlurm, choice: str, reason: str) -> CliSlurm:
    if choice == "pyslurm":
        raise SlurmError(
            f"{BACKEND_ENV}=pyslurm was asked for, but {reason}",
            hint="install the pyslurm release made for this Slurm, or unset the variable.",
        )
    logger.debug("using the CLI backend: %s", reason)
    return cli
