"""Host facts: memory from ``/proc/meminfo``, free space of the configured paths."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from torchpass_slurm.health.facts import DiskFacts, HostFacts

__all__ = ["gather_host", "parse_meminfo"]

MEMINFO = "/proc/meminfo"


def parse_meminfo(text: str) -> tuple[float | None, float | None]:
    """(MemTotal, MemAvailable) in MB from ``/proc/meminfo`` text."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key.strip()] = int(parts[0]) / 1024.0  # kB -> MB
    return values.get("MemTotal"), values.get("MemAvailable")


def _disk(path: str) -> DiskFacts:
    try:
        usage = shutil.disk_usage(path)
    except OSError as err:
        return DiskFacts(path, error=err.strerror or str(err))
    return DiskFacts(path, free_mb=usage.free / 2**20, total_mb=usage.total / 2**20)


def gather_host(disk_paths: Sequence[str], meminfo: str | os.PathLike[str] = MEMINFO) -> HostFacts:
    """Memory and disk facts; a file that cannot be read is an error in the facts, never an exception."""
    disks = tuple(_disk(p) for p in disk_paths)
    try:
        total, available = parse_meminfo(Path(meminfo).read_text())
    except OSError as err:
        return HostFacts(disks=disks, error=f"cannot read {meminfo}: {err.strerror}")
    return HostFacts(memory_total_mb=total, memory_available_mb=available, disks=disks)
