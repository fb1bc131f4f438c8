"""The admin's health thresholds: one dataclass, one loader.

Precedence: ``--config FILE`` > ``$TORCHPASS_HEALTH_CONFIG`` > :data:`DEFAULT_CONFIG_PATH`
(when it exists) > the defaults below. The file is TOML (``.toml``, read with
``tomllib``) or JSON (any other name), with top-level keys named as the fields
of :class:`HealthConfig`. Unknown keys and values of the wrong type are errors
that name the key, the value and what is valid.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from torchpass_slurm.errors import ConfigError

__all__ = [
    "CONFIG_ENV",
    "DEFAULT_CONFIG_PATH",
    "HealthConfig",
    "SIMULATE_ENV",
    "SOURCES",
    "STATUS_WORDS",
    "load_config",
    "parse_config",
]

#: Environment variable naming the config file.
CONFIG_ENV = "TORCHPASS_HEALTH_CONFIG"
#: Environment variable naming the simulated source's JSON file (beats ``simulate_file``).
SIMULATE_ENV = "TORCHPASS_HEALTH_SIMULATE"
#: Read when neither ``--config`` nor :data:`CONFIG_ENV` names a file, if it exists.
DEFAULT_CONFIG_PATH = "/etc/torchpass/health.toml"

SOURCES = ("auto", "nvml", "amdsmi", "simulated")
#: Values of the ``*_status`` settings: which status a finding gets.
STATUS_WORDS = ("ok", "warning", "critical")
PROLOG_DRAIN_MODES = ("scontrol", "slurmd")


@dataclass(frozen=True)
class HealthConfig:
    """Thresholds and behaviour of ``tp health``. Defaults are documented in docs/admin-guide.md."""

    # --- where facts come from -------------------------------------------------
    source: str = "auto"
    simulate_file: str = ""
    state_file: str = "/var/lib/torchpass/health-state.json"
    #: Bound on gathering the facts (device and host, in parallel, each in a child process
    #: killed at the bound), seconds. With slurm_timeout_s it keeps a hook under 10 s.
    timeout_s: float = 5.0
    #: Bound on each Slurm command a hook runs (at most two: node-check's look and drain).
    slurm_timeout_s: float = 1.5
    # --- GPUs -------------------------------------------------------------------
    #: GPUs this node must have; 0 = do not check the count.
    expected_gpus: int = 0
    ecc_uncorrected_critical: int = 1
    #: Corrected ECC errors per hour.
    ecc_corrected_rate_warning: float = 100.0
    ecc_corrected_rate_critical: float = 1000.0
    #: The rate is measured against a sample at least this old...
    ecc_rate_min_interval_s: float = 60.0
    #: ...and the stored sample is replaced once it is older than this.
    ecc_rate_window_s: float = 3600.0
    retired_pages_critical: int = 60
    retired_pages_pending_status: str = "warning"
    xid_critical: tuple[int, ...] = (48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120)
    #: XIDs that user code causes (bad address, page fault...): never held against the node.
    xid_ignore: tuple[int, ...] = (13, 31, 43, 45)
    #: Warn this many degrees below the slowdown threshold; CRITICAL at slowdown.
    temperature_margin_c: float = 5.0
    #: Used when the GPU does not report its slowdown threshold.
    temperature_warning_c: float = 83.0
    temperature_critical_c: float = 90.0
    throttle_warning: tuple[str, ...] = (
        "hw_slowdown",
        "hw_thermal_slowdown",
        "hw_power_brake_slowdown",
        "sw_thermal_slowdown",
    )
    throttle_critical: tuple[str, ...] = ()
    #: A link narrower than its maximum. Idle GPUs lower their PCIe generation to save
    #: power, so a lower generation is "ok" unless the admin says otherwise.
    pcie_width_status: str = "warning"
    pcie_gen_status: str = "ok"
    #: Sum of NVLink error counters of one GPU; 0 = off.
    nvlink_errors_warning: int = 100
    nvlink_errors_critical: int = 0
    # --- host -------------------------------------------------------------------
    memory_available_warning_pct: float = 10.0
    memory_available_critical_pct: float = 3.0
    #: Less total memory than this (a lost DIMM); 0 = off.
    memory_total_min_mb: float = 0.0
    #: Where Slurm and the jobs write (SlurmdSpoolDir, the job output dir, /tmp).
    disk_paths: tuple[str, ...] = ("/var/spool/slurmd", "/tmp")
    disk_free_warning_mb: float = 2048.0
    disk_free_critical_mb: float = 512.0
    # --- drain etiquette -----------------------------------------------------------
    #: Drain when a check broke (UNKNOWN). Off: a broken check never drains a node.
    drain_on_unknown: bool = False
    #: node-check: resume a node torchpass drained once it is OK again.
    auto_resume: bool = False
    #: Prolog/Epilog on CRITICAL: "scontrol" drains with the torchpass: reason (one call),
    #: "slurmd" only exits non-zero and lets slurmd drain ("Prolog error").
    prolog_drain: str = "scontrol"

    def __post_init__(self) -> None:
        _check_choice("source", self.source, SOURCES)
        _check_choice("prolog_drain", self.prolog_drain, PROLOG_DRAIN_MODES)
        for name in ("retired_pages_pending_status", "pcie_width_status", "pcie_gen_status"):
            _check_choice(name, getattr(self, name), STATUS_WORDS)
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                raise ConfigError(
                    f"health setting {f.name} = {value!r} is negative",
                    hint="thresholds are zero or more (0 turns some checks off)",
                )
        for name in ("timeout_s", "slurm_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"health setting {name} = {getattr(self, name)!r} must be above 0")

    def as_dict(self) -> dict[str, Any]:
        """The settings as plain JSON-able values (tuples become lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"health setting {name} = {value!r} is not one of {', '.join(choices)}")


_KINDS = {
    "str": str,
    "float": float,
    "int": int,
    "bool": bool,
    "tuple[int, ...]": int,
    "tuple[str, ...]": str,
}


def _coerce(name: str, kind: str, value: Any) -> Any:
    """``value`` as the field's type, or a ConfigError that says what was expected."""
    base = _KINDS[kind]
    if kind.startswith("tuple"):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"health setting {name} must be a list, got {value!r}")
        return tuple(_coerce(name, base.__name__, item) for item in value)
    ok = isinstance(value, base) and not (base is not bool and isinstance(value, bool))
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        raise ConfigError(f"health setting {name} must be {base.__name__}, got {value!r}")
    return value


def parse_config(values: Mapping[str, Any], *, origin: str = "the health config") -> HealthConfig:
    """Build a :class:`HealthConfig` from a mapping; unknown keys list the valid ones."""
    kinds = {f.name: str(f.type) for f in fields(HealthConfig)}
    unknown = sorted(set(values) - set(kinds))
    if unknown:
        raise ConfigError(
            f"unknown key(s) in {origin}: {', '.join(unknown)}",
            hint=f"valid keys: {', '.join(sorted(kinds))}",
        )
    try:
        return HealthConfig(**{k: _coerce(k, kinds[k], v) for k, v in values.items()})
    except ConfigError as err:
        raise ConfigError(f"{origin}: {err.message}", hint=err.hint) from None


def _read_file(path: Path) -> Mapping[str, Any]:
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"cannot read the health config {path}: {err.strerror}") from None
    try:
        if path.suffix == ".toml":
            if sys.version_info >= (3, 11):
                import tomllib
            else:
                import tomli as tomllib
            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except ValueError as err:  # TOMLDecodeError and JSONDecodeError are ValueErrors
        raise ConfigError(f"the health config {path} does not parse: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"the health config {path} must hold a table of settings")
    return data


def load_config(path: str | os.PathLike[str] | None = None) -> HealthConfig:
    """The config from ``path``, else :data:`CONFIG_ENV`, else :data:`DEFAULT_CONFIG_PATH`, else defaults."""
    chosen = path or os.environ.get(CONFIG_ENV) or None
    if chosen is None:
        if not Path(DEFAULT_CONFIG_PATH).is_file():
            return HealthConfig()
        chosen = DEFAULT_CONFIG_PATH
    file = Path(chosen)
    return parse_config(_read_file(file), origin=str(file))
