"""What ``tp health install`` shows and writes: slurm.conf lines, a config template, wrappers.

Pure: :func:`install_files` renders every file from a few paths; the CLI prints
them or writes them (never over an existing file unless asked).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from torchpass_slurm.health.config import DEFAULT_CONFIG_PATH, HealthConfig

__all__ = ["InstallFile", "InstallPaths", "install_files", "render_config_template", "slurm_conf_lines"]


@dataclass(frozen=True)
class InstallPaths:
    """Where things live on the nodes."""

    tp: str = "/usr/local/bin/tp"
    script_dir: str = "/etc/slurm"
    config: str = DEFAULT_CONFIG_PATH
    health_check_interval: int = 300


@dataclass(frozen=True)
class InstallFile:
    """One file: its name (written under --write DIR), where it belongs, its text, its mode."""

    name: str
    destination: str
    text: str
    mode: int = 0o644


def slurm_conf_lines(paths: InstallPaths) -> str:
    """The slurm.conf lines (same file on every node and the controller; `scontrol reconfigure`)."""
    d = paths.script_dir
    return (
        "# torchpass health checks (tp health install)\n"
        f"Prolog={d}/torchpass-prolog.sh\n"
        f"Epilog={d}/torchpass-epilog.sh\n"
        "# no PrologFlags=Alloc: tp run starts a step on every node (spares too) at once, and a\n"
        "# node merged into a running job (a spare refill) never gets the allocation prolog\n"
        "# and add permit_job_expansion to your SchedulerParameters (spare pool refills)\n"
        f"HealthCheckProgram={d}/torchpass-healthcheck.sh\n"
        f"HealthCheckInterval={paths.health_check_interval}\n"
        "HealthCheckNodeState=ANY,CYCLE\n"
    )


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string
    return repr(value)


def render_config_template(config: HealthConfig | None = None) -> str:
    """Every setting with its default, as TOML (docs/admin-guide.md explains each)."""
    config = config or HealthConfig()
    lines = [
        "# torchpass health thresholds: every key with its default (docs/admin-guide.md).",
        "# Unknown keys are errors. Delete the lines you do not change.",
        "",
    ]
    lines += [f"{f.name} = {_toml_value(getattr(config, f.name))}" for f in fields(config)]
    return "\n".join(lines) + "\n"


_WRAPPER = """#!/bin/sh
# torchpass {what}: {when}
# Installed by `tp health install`. Quiet on success; the reason of a failure goes
# to stderr and syslog. tp bounds itself (timeout_s); `timeout` is the backstop:
# if tp itself hangs, the check broke and the node is not drained for it.
export TORCHPASS_HEALTH_CONFIG="${{TORCHPASS_HEALTH_CONFIG:-{config}}}"
timeout -k 5 {bound} {tp} -q health {mode}
rc=$?
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    logger -t torchpass "tp health {mode} ran past {bound} s; not draining" 2>/dev/null
    exit 0
fi
exit $rc
"""


#: The wrappers' backstop, seconds: well above timeout_s, below PrologEpilogTimeout.
WRAPPER_TIMEOUT_S = 60


def _wrapper(paths: InstallPaths, mode: str, what: str, when: str) -> str:
    return _WRAPPER.format(
        what=what, when=when, config=paths.config, tp=paths.tp, mode=mode, bound=WRAPPER_TIMEOUT_S
    )


def install_files(paths: InstallPaths) -> list[InstallFile]:
    """The files to install, in the order they are shown."""
    d = paths.script_dir
    return [
        InstallFile("slurm.conf.torchpass", "slurm.conf (append)", slurm_conf_lines(paths)),
        InstallFile("health.toml", paths.config, render_config_template()),
        InstallFile(
            "torchpass-prolog.sh",
            f"{d}/torchpass-prolog.sh",
            _wrapper(paths, "prolog", "Slurm Prolog", "run as root by slurmd on each allocated node."),
            0o755,
        ),
        InstallFile(
            "torchpass-epilog.sh",
            f"{d}/torchpass-epilog.sh",
            _wrapper(paths, "epilog", "Slurm Epilog", "run as root by slurmd after each job."),
            0o755,
        ),
        InstallFile(
            "torchpass-healthcheck.sh",
            f"{d}/torchpass-healthcheck.sh",
            _wrapper(
                paths,
                "node-check",
                "Slurm HealthCheckProgram",
                "run by slurmd every HealthCheckInterval; drains the node itself.",
            ),
            0o755,
        ),
    ]
