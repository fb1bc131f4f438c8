"""GPU facts from NVML (``pynvml``, shipped by the ``nvidia-ml-py`` package).

pynvml is imported inside :meth:`NvmlSource.gpus`. Every NVML call is guarded:

* the library missing, failing to load, or ``nvmlInit`` / ``nvmlDeviceGetCount``
  failing -> :class:`SourceError` (every GPU check UNKNOWN);
* ``NVML_ERROR_GPU_IS_LOST`` -> the GPU is marked lost (the node is bad);
* ``NVML_ERROR_NOT_SUPPORTED`` -> the field is None (not reported);
* any other error of one query -> that field is named in ``GpuFacts.errors``
  (its check UNKNOWN).

NVML keeps no history of XID errors (they reach the kernel log), so
``xid_errors`` is None here: use the kernel log, NHC's own checks, or DCGM for them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

from torchpass_slurm.errors import SourceError
from torchpass_slurm.health.facts import THROTTLE_REASONS, GpuFacts, NvlinkCounter
from torchpass_slurm.health.sources import library_error, load_library

logger = logging.getLogger(__name__)

__all__ = ["NvmlSource", "NvmlQueries", "describe"]

T = TypeVar("T")

# NVML constants, with their documented values as fallbacks for old bindings.
_ERROR_INVALID_ARGUMENT = 2
_ERROR_NOT_SUPPORTED = 3
_ERROR_GPU_IS_LOST = 15
_NVLINK_COUNTERS = {0: "replay", 1: "recovery", 2: "crc_flit", 3: "crc_data"}
_NVLINK_MAX_LINKS = 18


def describe(err: BaseException) -> str:
    """``NVMLError_LibRmVersionMismatch: RM has detected an NVML/RM version mismatch.``"""
    return f"{type(err).__name__}: {err}"


class NvmlQueries:
    """Runs NVML calls for one GPU, sorting failures into lost / not supported / failed.

    ``error`` is what a failed call raises: pynvml's NVMLError here; the event waiter inside
    the training (``health/gpu_events.py``) passes ``Exception``, so that a broken binding's
    odd error is a failed read, never the training's."""

    def __init__(self, error: type[Exception]) -> None:
        self.error = error
        self.lost = False
        self.errors: dict[str, str] = {}

    @staticmethod
    def code(err: Exception) -> int | None:
        return getattr(err, "value", None)

    def __call__(self, field: str, fn: Callable[..., T], *args: Any) -> T | None:
        try:
            return fn(*args)
        except self.error as err:
            code = self.code(err)
            if code == _ERROR_NOT_SUPPORTED:
                return None
            if code == _ERROR_GPU_IS_LOST:
                self.lost = True
                return None
            self.errors.setdefault(field, describe(err))
            logger.debug("NVML %s failed: %s", field, describe(err))
            return None


class NvmlSource:
    """NVIDIA GPUs through NVML; ``module`` replaces ``import pynvml`` (tests)."""

    name = "nvml"

    def __init__(self, module: ModuleType | None = None) -> None:
        self._module = module

    def _load(self) -> ModuleType:
        return load_library(self._module, "pynvml", "pip install nvidia-ml-py (or torchpass-slurm[gpu])")

    def gpus(self) -> tuple[GpuFacts, ...]:
        nvml = self._load()
        error = library_error(nvml, "pynvml", "NVMLError")
        try:
            nvml.nvmlInit()
        except error as err:
            raise SourceError(
                f"NVML did not initialise: {describe(err)}",
                hint="check the driver (nvidia-smi); a driver/library mismatch needs a reboot",
            ) from None
        try:
            try:
                count = int(nvml.nvmlDeviceGetCount())
            except error as err:
                raise SourceError(f"NVML could not count the GPUs: {describe(err)}") from None
            return tuple(self._gpu(nvml, error, index) for index in range(count))
        finally:
            try:
                nvml.nvmlShutdown()
            except error as err:
                logger.debug("nvmlShutdown: %s", describe(err))

    def _gpu(self, nvml: ModuleType, error: type[Exception], index: int) -> GpuFacts:
        q = NvmlQueries(error)
        handle = q("handle", nvml.nvmlDeviceGetHandleByIndex, index)
        if handle is None:
            return GpuFacts(
                index=index,
                uuid=f"index-{index}",
                lost=q.lost,
                errors=tuple((("*", q.errors["handle"]),) if "handle" in q.errors else ()),
            )
        uuid = _text(q("uuid", nvml.nvmlDeviceGetUUID, handle)) or f"index-{index}"
        facts = dict(
            name=_text(q("name", nvml.nvmlDeviceGetName, handle)) or "",
            **_thermal(q, nvml, handle),
            **_memory(q, nvml, handle),
            throttle_reasons=_throttle(q, nvml, handle),
            **_pcie(q, nvml, handle),
            nvlink_errors=_nvlink(q, nvml, handle),
        )
        return GpuFacts(index=index, uuid=uuid, lost=q.lost, errors=tuple(sorted(q.errors.items())), **facts)


def _text(value: object) -> str | None:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return None if value is None else str(value)


def _const(nvml: ModuleType, name: str, default: int) -> int:
    return int(getattr(nvml, name, default))


def _thermal(q: NvmlQueries, nvml: ModuleType, h: Any) -> dict[str, Any]:
    threshold = nvml.nvmlDeviceGetTemperatureThreshold
    return dict(
        temperature_c=q(
            "temperature_c", nvml.nvmlDeviceGetTemperature, h, _const(nvml, "NVML_TEMPERATURE_GPU", 0)
        ),
        slowdown_c=q("slowdown_c", threshold, h, _const(nvml, "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN", 1)),
        shutdown_c=q("shutdown_c", threshold, h, _const(nvml, "NVML_TEMPERATURE_THRESHOLD_SHUTDOWN", 0)),
    )


def _memory(q: NvmlQueries, nvml: ModuleType, h: Any) -> dict[str, Any]:
    total = nvml.nvmlDeviceGetTotalEccErrors
    corrected = _const(nvml, "NVML_MEMORY_ERROR_TYPE_CORRECTED", 0)
    uncorrected = _const(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)
    retired = None
    for cause in (0, 1):  # multiple single-bit, double-bit
        pages = q("retired_pages", nvml.nvmlDeviceGetRetiredPages, h, cause)
        if pages is not None:
            retired = (retired or 0) + len(pages)
    pending = q("retired_pages_pending", nvml.nvmlDeviceGetRetiredPagesPendingStatus, h)
    rows = q("remapped_rows", nvml.nvmlDeviceGetRemappedRows, h)
    return dict(
        ecc_corrected=q("ecc_corrected", total, h, corrected, _const(nvml, "NVML_AGGREGATE_ECC", 1)),
        ecc_uncorrected=q("ecc_uncorrected", total, h, uncorrected, _const(nvml, "NVML_VOLATILE_ECC", 0)),
        retired_pages=retired,
        retired_pages_pending=None if pending is None else bool(pending),
        remapped_rows_pending=None if rows is None else bool(rows[2]),
        remapped_rows_failure=None if rows is None else bool(rows[3]),
    )


def _throttle(q: NvmlQueries, nvml: ModuleType, h: Any) -> tuple[str, ...] | None:
    fn = (
        getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    )
    mask = q("throttle_reasons", fn, h)
    if mask is None:
        return None
    return tuple(name for bit, name in THROTTLE_REASONS.items() if int(mask) & bit)


def _pcie(q: NvmlQueries, nvml: ModuleType, h: Any) -> dict[str, Any]:
    return dict(
        pcie_gen=q("pcie_gen", nvml.nvmlDeviceGetCurrPcieLinkGeneration, h),
        pcie_gen_max=q("pcie_gen", nvml.nvmlDeviceGetMaxPcieLinkGeneration, h),
        pcie_width=q("pcie_width", nvml.nvmlDeviceGetCurrPcieLinkWidth, h),
        pcie_width_max=q("pcie_width", nvml.nvmlDeviceGetMaxPcieLinkWidth, h),
    )


def _nvlink(q: NvmlQueries, nvml: ModuleType, h: Any) -> tuple[NvlinkCounter, ...] | None:
    """Error counters of every active link; None when the GPU has no NVLink."""
    counters: list[NvlinkCounter] = []
    any_link = False
    for link in range(_const(nvml, "NVML_NVLINK_MAX_LINKS", _NVLINK_MAX_LINKS)):
        try:
            active = nvml.nvmlDeviceGetNvLinkState(h, link)
        except q.error as err:
            if q.code(err) in (_ERROR_NOT_SUPPORTED, _ERROR_INVALID_ARGUMENT):
                continue  # no such link on this GPU
            q.errors.setdefault("nvlink_errors", describe(err))
            return None
        any_link = True
        if not active:
            continue
        for code, counter in _NVLINK_COUNTERS.items():
            value = q("nvlink_errors", nvml.nvmlDeviceGetNvLinkErrorCounter, h, link, code)
            if value is not None:
                counters.append(NvlinkCounter(link, counter, int(value)))
    return tuple(counters) if any_link else None
