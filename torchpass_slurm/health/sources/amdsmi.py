"""GPU facts from AMD SMI (``amdsmi``), for the facts that have an AMD equivalent.

Mapping: temperature (hotspot) with the CRITICAL / EMERGENCY limits as slowdown /
shutdown, the total ECC counts (correctable, uncorrectable), bad pages (retired;
``pending`` ones as a pending retirement), PCIe speed and width against their
maximum, and the XGMI error status as the link counter. Throttle reasons and
XIDs have no AMD equivalent here (None: "not reported"). The same guards as
NVML: a failing library is a :class:`SourceError`, a failing query names its field.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

from torchpass_slurm.errors import SourceError
from torchpass_slurm.health.facts import GpuFacts, NvlinkCounter
from torchpass_slurm.health.sources import library_error, load_library

logger = logging.getLogger(__name__)

__all__ = ["AmdSmiSource"]

T = TypeVar("T")

#: PCIe transfer rate (MT/s) -> generation.
_PCIE_GEN = {2500: 1, 5000: 2, 8000: 3, 16000: 4, 32000: 5, 64000: 6}


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _not_supported(amdsmi: ModuleType, err: BaseException) -> bool:
    code = getattr(err, "get_error_code", lambda: None)()
    codes = getattr(amdsmi, "AmdSmiRetCode", None)
    return code is not None and code == getattr(codes, "STATUS_NOT_SUPPORTED", object())


class AmdSmiSource:
    """AMD GPUs through AMD SMI; ``module`` replaces ``import amdsmi`` (tests)."""

    name = "amdsmi"

    def __init__(self, module: ModuleType | None = None) -> None:
        self._module = module

    def _load(self) -> ModuleType:
        return load_library(self._module, "amdsmi", "install the amdsmi package of the node's ROCm release")

    def gpus(self) -> tuple[GpuFacts, ...]:
        smi = self._load()
        error = library_error(smi, "amdsmi", "AmdSmiException")  # the base of every AMD SMI error
        try:
            smi.amdsmi_init()
            handles = list(smi.amdsmi_get_processor_handles())
        except error as err:
            raise SourceError(f"AMD SMI did not initialise: {_describe(err)}") from None
        try:
            return tuple(self._gpu(smi, error, index, h) for index, h in enumerate(handles))
        finally:
            try:
                smi.amdsmi_shut_down()
            except error as err:
                logger.debug("amdsmi_shut_down: %s", _describe(err))

    def _gpu(self, smi: ModuleType, error: type[Exception], index: int, h: Any) -> GpuFacts:
        errors: dict[str, str] = {}

        def q(field: str, fn: Callable[..., T], *args: Any) -> T | None:
            try:
                return fn(*args)
            except error as err:
                if not _not_supported(smi, err):
                    errors.setdefault(field, _describe(err))
                return None

        kind = getattr(getattr(smi, "AmdSmiTemperatureType", None), "HOTSPOT", 1)
        metric = getattr(smi, "AmdSmiTemperatureMetric", None)

        def temp(field: str, which: str, default: int) -> Any:
            return q(field, smi.amdsmi_get_temp_metric, h, kind, getattr(metric, which, default))

        ecc = q("ecc_corrected", smi.amdsmi_get_gpu_total_ecc_count, h) or {}
        if "ecc_corrected" in errors:
            errors["ecc_uncorrected"] = errors["ecc_corrected"]
        pages = q("retired_pages", smi.amdsmi_get_gpu_bad_page_info, h)
        pcie = q("pcie_gen", smi.amdsmi_get_pcie_info, h) or {}
        if "pcie_gen" in errors:
            errors["pcie_width"] = errors["pcie_gen"]
        xgmi = q("nvlink_errors", smi.amdsmi_gpu_xgmi_error_status, h)
        static, live = pcie.get("pcie_static", {}), pcie.get("pcie_metric", {})
        return GpuFacts(
            index=index,
            uuid=str(q("uuid", smi.amdsmi_get_gpu_device_uuid, h) or f"index-{index}"),
            temperature_c=temp("temperature_c", "CURRENT", 0),
            slowdown_c=temp("slowdown_c", "CRITICAL", 4),
            shutdown_c=temp("shutdown_c", "EMERGENCY", 6),
            ecc_corrected=ecc.get("correctable_count"),
            ecc_uncorrected=ecc.get("uncorrectable_count"),
            retired_pages=None if pages is None else len(pages),
            retired_pages_pending=None if pages is None else any(_pending(p) for p in pages),
            pcie_gen=_PCIE_GEN.get(live.get("pcie_speed")),
            pcie_gen_max=_PCIE_GEN.get(static.get("max_pcie_speed")),
            pcie_width=live.get("pcie_width"),
            pcie_width_max=static.get("max_pcie_width"),
            nvlink_errors=None
            if xgmi is None
            else (NvlinkCounter(0, "xgmi", int(getattr(xgmi, "value", xgmi))),),
            errors=tuple(sorted(errors.items())),
        )


def _pending(page: Any) -> bool:
    status = page.get("status") if isinstance(page, dict) else None
    return "PENDING" in str(status).upper()
