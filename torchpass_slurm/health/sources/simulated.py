"""A device source read from a JSON file: tests and the dockerized cluster fake GPUs with it.

The file (``$TORCHPASS_HEALTH_SIMULATE`` or ``simulate_file``) is read on every
run, so a test can change it between runs::

    {"gpus": [
        {"index": 0, "uuid": "GPU-0", "temperature_c": 64, "slowdown_c": 88, "shutdown_c": 95,
         "ecc_corrected": 12, "ecc_uncorrected": 0, "xid_errors": [],
         "throttle_reasons": [], "pcie_gen": 4, "pcie_gen_max": 4, "pcie_width": 16, "pcie_width_max": 16,
         "nvlink_errors": [{"link": 0, "counter": "replay", "value": 0}]},
        {"index": 1, "uuid": "GPU-1", "lost": true}
    ]}

Any :class:`GpuFacts` field may be given (unknown fields are errors); one that is
left out is "not reported". ``{"broken": "NVML_ERROR_LIB_RM_VERSION_MISMATCH"}``
makes the library look broken (SourceError: UNKNOWN), ``{"hang_s": 30}`` makes it
hang (the run's timeout turns that into UNKNOWN), and ``"errors": {"field": "text"}``
on a GPU makes one query fail.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from torchpass_slurm.errors import SourceError
from torchpass_slurm.health.facts import GpuFacts, NvlinkCounter

logger = logging.getLogger(__name__)

__all__ = ["SimulatedSource"]

_FIELDS = {f.name for f in fields(GpuFacts)}
#: The file's top-level keys: the JSON type each must have, and how to say it.
_TOP: dict[str, tuple[tuple[type, ...], str]] = {
    "gpus": ((list,), "a list of GPU objects"),
    "broken": ((str,), "a string (the error the library reports)"),
    "hang_s": ((int, float), "a number of seconds"),
}
_TUPLES = ("xid_errors", "throttle_reasons")
#: The JSON type each scalar field must have ("lost": "no" is a mistake, not a lost GPU).
_SCALARS: dict[str, tuple[type, ...]] = {
    "index": (int,),
    "uuid": (str,),
    "name": (str,),
    "lost": (bool,),
    **{n: (int, float) for n in ("temperature_c", "slowdown_c", "shutdown_c")},
    **{
        n: (int,)
        for n in (
            "ecc_corrected",
            "ecc_uncorrected",
            "retired_pages",
            "pcie_gen",
            "pcie_gen_max",
            "pcie_width",
            "pcie_width_max",
        )
    },
    **{n: (bool,) for n in ("retired_pages_pending", "remapped_rows_pending", "remapped_rows_failure")},
}


class SimulatedSource:
    """GPU facts from a JSON file (see the module docstring for its form)."""

    name = "simulated"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def gpus(self) -> tuple[GpuFacts, ...]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError) as err:
            raise SourceError(f"cannot read the simulated devices file {self.path}: {err}") from None
        if not isinstance(data, dict):
            raise SourceError(f"{self.path}: expected an object with a 'gpus' list")
        self._check_top(data)
        if data.get("hang_s"):
            logger.debug("simulated source: hanging %s s", data["hang_s"])
            time.sleep(float(data["hang_s"]))
        if data.get("broken"):
            raise SourceError(f"the simulated library is broken: {data['broken']}")
        return tuple(self._gpu(i, raw) for i, raw in enumerate(data.get("gpus", [])))

    def _check_top(self, data: dict[str, Any]) -> None:
        unknown = sorted(set(data) - set(_TOP))
        if unknown:
            raise SourceError(
                f"{self.path}: unknown key(s) {', '.join(unknown)}",
                hint=f"valid keys: {', '.join(sorted(_TOP))}",
            )
        for name, (types, wanted) in _TOP.items():
            value = data.get(name)
            if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
                raise SourceError(f"{self.path}: {name} is {value!r}; expected {wanted}")

    def _gpu(self, position: int, raw: Any) -> GpuFacts:
        if not isinstance(raw, dict):
            raise SourceError(f"{self.path}: gpus[{position}] is not an object")
        unknown = sorted(set(raw) - _FIELDS)
        if unknown:
            raise SourceError(
                f"{self.path}: gpus[{position}] has unknown field(s) {', '.join(unknown)}",
                hint=f"valid fields: {', '.join(sorted(_FIELDS))}",
            )
        for name, types in _SCALARS.items():
            value = raw.get(name)
            if value is None:
                continue  # absent or null: the field's default
            if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                wanted = " or ".join(t.__name__ for t in types)
                raise SourceError(f"{self.path}: gpus[{position}].{name} is {value!r}; expected {wanted}")
        values = dict(raw)
        values.setdefault("index", position)
        values.setdefault("uuid", f"SIM-GPU-{values['index']}")
        for name in _TUPLES:
            if values.get(name) is not None:
                values[name] = tuple(values[name])
        if values.get("nvlink_errors") is not None:
            values["nvlink_errors"] = tuple(NvlinkCounter(**c) for c in values["nvlink_errors"])
        values["errors"] = tuple(sorted(dict(values.get("errors") or {}).items()))
        try:
            return GpuFacts(**values)
        except TypeError as err:
            raise SourceError(f"{self.path}: gpus[{position}]: {err}") from None
