"""What a health run sees, gathered once and frozen: :class:`Facts`.

Sources (:mod:`torchpass_slurm.health.sources`) fill :class:`GpuFacts`;
:mod:`torchpass_slurm.health.host` fills :class:`HostFacts`. The checks in
:mod:`torchpass_slurm.health.checks` only ever read these objects.

A field is ``None`` when the source does not report it (not supported: the
check says so and passes). A field whose query FAILED is named in
``GpuFacts.errors`` with the error text: the check of that field is UNKNOWN
(the check broke), never CRITICAL.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "DiskFacts",
    "EccSample",
    "Facts",
    "GpuFacts",
    "HostFacts",
    "NvlinkCounter",
    "THROTTLE_REASONS",
    "gpus_from_json",
    "gpus_to_json",
    "host_from_json",
    "host_to_json",
]

#: Throttle (clock event) reasons by NVML bit, with the names the config uses.
THROTTLE_REASONS: Mapping[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


@dataclass(frozen=True)
class NvlinkCounter:
    """One NVLink error counter of one link (``replay``, ``recovery``, ``crc_flit``, ``crc_data``)."""

    link: int
    counter: str
    value: int


@dataclass(frozen=True)
class GpuFacts:
    """One GPU as its management library reports it."""

    index: int
    uuid: str
    name: str = ""
    #: The GPU answered with "lost" (fell off the bus): the node is bad.
    lost: bool = False
    temperature_c: float | None = None
    slowdown_c: float | None = None
    shutdown_c: float | None = None
    #: Corrected ECC errors, aggregate (lifetime) count: the rate is taken over it.
    ecc_corrected: int | None = None
    #: Uncorrected ECC errors, volatile count (since the driver loaded).
    ecc_uncorrected: int | None = None
    retired_pages: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    #: XID error codes seen; None when the source cannot tell.
    xid_errors: tuple[int, ...] | None = None
    #: Active throttle reasons by name (see :data:`THROTTLE_REASONS`).
    throttle_reasons: tuple[str, ...] | None = None
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    nvlink_errors: tuple[NvlinkCounter, ...] | None = None
    #: field name -> error text, for every query that failed ("*": all of them).
    errors: tuple[tuple[str, str], ...] = ()

    def error_for(self, *names: str) -> str | None:
        """The error text of the first of ``names`` whose query failed, else None."""
        failed = dict(self.errors)
        for name in ("*", *names):
            if name in failed:
                return failed[name]
        return None


@dataclass(frozen=True)
class DiskFacts:
    """Free space of one configured path (``free_mb`` None with ``error`` when it could not be read)."""

    path: str
    free_mb: float | None = None
    total_mb: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class HostFacts:
    """The host's memory and the free space where Slurm and the jobs write."""

    memory_total_mb: float | None = None
    memory_available_mb: float | None = None
    disks: tuple[DiskFacts, ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class EccSample:
    """One earlier reading of a GPU's corrected-ECC counter (from the state file)."""

    uuid: str
    ecc_corrected: int
    time: float


@dataclass(frozen=True)
class Facts:
    """Everything one health run judges; gathered once, then read by every check.

    ``gpus`` is None when the device source failed (``gpu_error`` says why);
    ``host`` is None when the host facts could not be gathered in time.
    """

    time: float
    node: str
    source: str
    gpus: tuple[GpuFacts, ...] | None = None
    gpu_error: str | None = None
    host: HostFacts | None = None
    previous_ecc: Mapping[str, EccSample] = field(default_factory=dict)


# --- as JSON, for the child process that gathers them (health/child.py) -----------------------


def gpus_to_json(gpus: tuple[GpuFacts, ...]) -> list[dict[str, object]]:
    """Plain JSON values of ``gpus`` (tuples become lists)."""
    return [asdict(g) for g in gpus]


def gpus_from_json(data: list[dict[str, Any]]) -> tuple[GpuFacts, ...]:
    """The inverse of :func:`gpus_to_json`."""
    out = []
    for raw in data:
        values = dict(raw)
        for name in ("xid_errors", "throttle_reasons"):
            if values.get(name) is not None:
                values[name] = tuple(values[name])
        if values.get("nvlink_errors") is not None:
            values["nvlink_errors"] = tuple(NvlinkCounter(**c) for c in values["nvlink_errors"])
        values["errors"] = tuple((k, v) for k, v in values.get("errors", ()))
        out.append(GpuFacts(**values))
    return tuple(out)


def host_to_json(host: HostFacts) -> dict[str, object]:
    """Plain JSON values of ``host``."""
    return asdict(host)


def host_from_json(data: dict[str, Any]) -> HostFacts:
    """The inverse of :func:`host_to_json`."""
    values = dict(data)
    values["disks"] = tuple(DiskFacts(**d) for d in values.get("disks", ()))
    return HostFacts(**values)
