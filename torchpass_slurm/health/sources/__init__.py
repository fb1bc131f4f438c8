"""Device sources: where GPU facts come from. Each is injectable.

A source has a ``name`` and ``gpus() -> tuple[GpuFacts, ...]``; it raises
:class:`~torchpass_slurm.errors.SourceError` when the library itself is
missing or broken (every GPU check is then UNKNOWN). Libraries are imported
inside ``gpus()``, never at module import.

* :class:`~.nvml.NvmlSource` (pynvml, from nvidia-ml-py)
* :class:`~.amdsmi.AmdSmiSource` (amdsmi)
* :class:`~.simulated.SimulatedSource` (a JSON file: tests, the dev cluster)
* :class:`NoGpuSource`: "auto" found no library (fine on a node without GPUs)
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType
from typing import Protocol, runtime_checkable

from torchpass_slurm.errors import ConfigError, SourceError
from torchpass_slurm.health.config import SIMULATE_ENV, HealthConfig
from torchpass_slurm.health.facts import GpuFacts

__all__ = ["DeviceSource", "NoGpuSource", "library_error", "load_library", "select_source"]


@runtime_checkable
class DeviceSource(Protocol):
    """Anything that can list the node's GPUs as :class:`GpuFacts`."""

    name: str

    def gpus(self) -> tuple[GpuFacts, ...]: ...


class NoGpuSource:
    """What "auto" gives when no GPU library is installed: the source itself is unavailable."""

    name = "none"

    def gpus(self) -> tuple[GpuFacts, ...]:
        raise SourceError(
            "no GPU library found (neither pynvml nor amdsmi imports)",
            hint="pip install 'torchpass-slurm[gpu]', or set expected_gpus = 0 on CPU nodes",
        )


def load_library(module: ModuleType | None, name: str, hint: str) -> ModuleType:
    """``module`` if given (tests), else ``import name``; a SourceError when it does not load."""
    if module is not None:
        return module
    try:
        return importlib.import_module(name)
    # Deliberately broad: a binding can fail at import in any way (ImportError, OSError
    # from its shared library, even SystemExit from a wrapper that calls sys.exit()).
    # None of it says the node is bad, and a SystemExit let through would end the
    # Prolog with the library's status. KeyboardInterrupt still stops the run.
    except (Exception, SystemExit) as err:
        raise SourceError(f"{name} does not import: {type(err).__name__}: {err}", hint=hint) from None


def library_error(module: ModuleType, name: str, attribute: str) -> type[Exception]:
    """The exception class ``module.attribute`` the library raises; a SourceError when it has none."""
    error = getattr(module, attribute, None)
    if isinstance(error, type) and issubclass(error, Exception):
        return error
    raise SourceError(
        f"{name} has no exception class {attribute}: it is not the binding torchpass-slurm knows",
        hint=f"install the official {name} package",
    )


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def select_source(config: HealthConfig, choice: str | None = None) -> DeviceSource:
    """The source for ``choice`` (the --source flag) > ``config.source``.

    ``auto``: simulated when :data:`SIMULATE_ENV` or ``simulate_file`` names a file,
    else NVML when pynvml imports, else AMD SMI, else :class:`NoGpuSource`.
    """
    choice = choice or config.source
    simulate = os.environ.get(SIMULATE_ENV) or config.simulate_file
    if choice == "auto":
        if simulate:
            choice = "simulated"
        elif _importable("pynvml"):
            choice = "nvml"
        elif _importable("amdsmi"):
            choice = "amdsmi"
        else:
            return NoGpuSource()
    if choice == "simulated":
        if not simulate:
            raise ConfigError(
                "the simulated source needs a file",
                hint=f"set {SIMULATE_ENV}=FILE or simulate_file in the health config",
            )
        from torchpass_slurm.health.sources.simulated import SimulatedSource

        return SimulatedSource(simulate)
    if choice == "nvml":
        from torchpass_slurm.health.sources.nvml import NvmlSource

        return NvmlSource()
    if choice == "amdsmi":
        from torchpass_slurm.health.sources.amdsmi import AmdSmiSource

        return AmdSmiSource()
    raise ConfigError(f"unknown health source {choice!r}", hint="valid: auto, nvml, amdsmi, simulated")
