"""Where the supervisor runs: its own component of a heterogeneous job, or the node of rank 0.

A site with a service (CPU) partition names it once, in tp-submit's site
configuration file; tp-submit then asks sbatch for a heterogeneous job whose
component 0 (one task, a few CPUs, a little memory in that partition) runs
the batch script, the supervisor and the rendezvous store, and whose
component 1 holds the N + S training nodes. Every training node can then be
replaced, the node of rank 0 included. Without a partition the batch host
is the node of rank 0, as before, and that node cannot be replaced.

Precedence, stated once: ``--supervisor-partition`` on the command line (or
a ``#TP`` line; ``none`` asks for today's layout) > ``TORCHPASS_SUPERVISOR_PARTITION``
> the file's ``[supervisor] partition`` > no supervisor component. The size
(``cpus``, ``mem_per_cpu``) comes from the file, else the defaults below.
The file is ``TORCHPASS_SUBMIT_CONFIG``, else :data:`SITE_CONFIG`; a missing
file is no configuration, a malformed one an error. Pure, except :func:`load_site_config`
reading the file.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchpass_slurm.errors import ConfigError

__all__ = [
    "ENV_SUBMIT_CONFIG",
    "ENV_SUPERVISOR_PARTITION",
    "NO_SUPERVISOR_PARTITION",
    "SITE_CONFIG",
    "SupervisorPlacement",
    "load_site_config",
    "load_site_tables",
    "resolve_placement",
]

#: The site configuration file of tp-submit (TOML), unless ENV_SUBMIT_CONFIG names another.
SITE_CONFIG = Path("/etc/torchpass/submit.toml")
ENV_SUBMIT_CONFIG = "TORCHPASS_SUBMIT_CONFIG"
ENV_SUPERVISOR_PARTITION = "TORCHPASS_SUPERVISOR_PARTITION"
#: ``--supervisor-partition none``: no supervisor component, whatever the site says.
NO_SUPERVISOR_PARTITION = "none"
#: The supervisor's size when the file does not say: it runs one Python process with a
#: ZeroMQ socket and a TCPStore (measured well under 200 MB resident).
DEFAULT_CPUS = 2
DEFAULT_MEM_PER_CPU = "1G"
_KEYS = ("partition", "cpus", "mem_per_cpu")
#: The site file's tables and their keys; ``[transfer] transport`` is the site's default
#: transport of live migrations (``submit/spec.py``, config.ENV_TRANSPORT).
_TABLES = {"supervisor": _KEYS, "transfer": ("transport",)}
_MEMORY = re.compile(r"[1-9][0-9]*[KMGT]?")


@dataclass(frozen=True)
class SupervisorPlacement:
    """Component 0 of a tp job: the batch script, ``tp run``, the rendezvous store."""

    partition: str
    cpus: int = DEFAULT_CPUS
    #: sbatch's --mem-per-cpu (a per-component option: --mem would be carried over to the
    #: training component, measured on Slurm 24.11)
    mem_per_cpu: str = DEFAULT_MEM_PER_CPU
    #: where the partition came from, for messages ("the command line", "/etc/torchpass/submit.toml")
    origin: str = "the command line"

    def sbatch_options(self) -> tuple[str, ...]:
        return (
            f"--partition={self.partition}",
            "--nodes=1",
            "--ntasks=1",
            f"--cpus-per-task={self.cpus}",
            f"--mem-per-cpu={self.mem_per_cpu}",
        )


def load_site_config(environ: Mapping[str, str] | None = None) -> tuple[dict[str, Any], str]:
    """The ``[supervisor]`` table of the site file and the file's path; ``{}`` when there is none."""
    tables, path = load_site_tables(environ)
    return tables.get("supervisor", {}), path


def load_site_tables(environ: Mapping[str, str] | None = None) -> tuple[dict[str, dict[str, Any]], str]:
    """Every table of the site file (``[supervisor]``, ``[transfer]``) and the file's path;
    ``{}`` when there is no file. Unknown tables and keys are errors that list the valid ones."""
    env = os.environ if environ is None else environ
    path = Path(env.get(ENV_SUBMIT_CONFIG) or SITE_CONFIG)
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python < 3.11
        import tomli as tomllib
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        return {}, str(path)
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(
            f"cannot read tp-submit's site configuration {path}: {err}",
            hint=f"fix the file, or point {ENV_SUBMIT_CONFIG} at another",
        ) from None
    unknown = sorted(set(data) - set(_TABLES))
    if unknown:
        raise ConfigError(
            f"{path}: unknown table(s) {', '.join(unknown)}; the valid ones are "
            + ", ".join(f"[{name}]" for name in _TABLES)
        )
    tables: dict[str, dict[str, Any]] = {}
    for name, keys in _TABLES.items():
        table = data.get(name, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: `{name}` must be a table ([{name}])")
        unknown = sorted(set(table) - set(keys))
        if unknown:
            raise ConfigError(
                f"{path}: unknown key(s) {', '.join(unknown)} in [{name}]; "
                f"the valid ones are {', '.join(keys)}"
            )
        tables[name] = dict(table)
    return tables, str(path)


def _checked(table: Mapping[str, Any], path: str) -> tuple[int, str]:
    cpus = table.get("cpus", DEFAULT_CPUS)
    if not isinstance(cpus, int) or isinstance(cpus, bool) or not 1 <= cpus <= 64:
        raise ConfigError(f"{path}: [supervisor] cpus must be a whole number from 1 to 64, got {cpus!r}")
    mem = table.get("mem_per_cpu", DEFAULT_MEM_PER_CPU)
    if not isinstance(mem, str) or not _MEMORY.fullmatch(mem):
        raise ConfigError(
            f'{path}: [supervisor] mem_per_cpu must be a size such as "512M" or "1G", got {mem!r}'
        )
    return cpus, mem


def resolve_placement(
    option: str | None, environ: Mapping[str, str], table: Mapping[str, Any], path: str
) -> SupervisorPlacement | None:
    """The supervisor component of one job, or None for the batch host on the node of rank 0."""
    cpus, mem = _checked(table, path)
    given = table.get("partition")
    if given is not None and (not isinstance(given, str) or not given.strip()):
        raise ConfigError(f"{path}: [supervisor] partition must be a partition's name, got {given!r}")
    for value, origin in (
        (option, "the command line"),
        (environ.get(ENV_SUPERVISOR_PARTITION), ENV_SUPERVISOR_PARTITION),
        (given, path),
    ):
        if value is None or value == "":
            continue
        if value.strip().lower() == NO_SUPERVISOR_PARTITION:
            return None
        return SupervisorPlacement(partition=value.strip(), cpus=cpus, mem_per_cpu=mem, origin=origin)
    return None
