"""``tp health``: node health checks, the Slurm hooks, install and undrain (docs/admin-guide.md).

Exit codes of ``check`` and ``node-check`` are Nagios': 0 OK, 1 WARNING,
2 CRITICAL (the node is bad), 3 UNKNOWN (the check broke; a bad config too).
``prolog`` / ``epilog`` exit 1 only when they want the node drained and the job
moved, else 0.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click

from torchpass_slurm.cli.app import App, pass_app, render_error, write_traceback
from torchpass_slurm.errors import ConfigError, TorchpassError

if TYPE_CHECKING:
    from torchpass_slurm.health.config import HealthConfig
    from torchpass_slurm.health.install import InstallFile
    from torchpass_slurm.health.run import HealthReport
    from torchpass_slurm.slurm import SlurmBackend

SOURCE_CHOICES = ("auto", "nvml", "amdsmi", "simulated")
_STYLE = {"OK": "green", "WARNING": "yellow", "CRITICAL": "bold red", "UNKNOWN": "magenta"}


def slurm_backend(timeout: float | None = None) -> SlurmBackend:
    """The Slurm layer (a seam for tests).

    With ``timeout`` (the hooks: ``slurm_timeout_s``) the command-line backend whose every
    command is killed after that many seconds; pyslurm's calls could not be bounded.
    """
    from torchpass_slurm.slurm import select_backend

    if timeout is None:
        return select_backend()
    from torchpass_slurm.slurm.runner import SubprocessRunner

    return select_backend(SubprocessRunner(timeout=timeout), choice="cli")


def clock() -> float:
    """Wall-clock time (a seam for tests)."""
    return time.time()


def notify(message: str) -> None:
    """One line to stderr and to syslog (Prolog output is not kept by slurmd)."""
    click.echo(message, err=True)
    try:
        import syslog

        syslog.openlog("torchpass", syslog.LOG_PID, syslog.LOG_DAEMON)
        syslog.syslog(syslog.LOG_WARNING, message)
    except (ImportError, OSError, ValueError):  # no syslog here (or a NUL in the text): stderr is enough
        pass


config_option = click.option(
    "--config",
    "config_path",
    metavar="FILE",
    type=click.Path(dir_okay=False),
    help="Thresholds file (TOML or JSON); default $TORCHPASS_HEALTH_CONFIG, then /etc/torchpass/health.toml.",
)
source_option = click.option(
    "--source",
    type=click.Choice(SOURCE_CHOICES),
    default=None,
    help="Where GPU facts come from (default: the config's, normally auto).",
)
node_option = click.option(
    "--node",
    metavar="NAME",
    default=None,
    help="This node's Slurm name (default $SLURMD_NODENAME, else the host name).",
)


def _evaluate(
    config_path: str | None, source: str | None, node: str | None
) -> tuple[HealthConfig, HealthReport]:
    """Load the config, gather once, judge. Raises ConfigError for a bad config or source."""
    from torchpass_slurm.health.config import load_config
    from torchpass_slurm.health.run import run_health
    from torchpass_slurm.health.sources import select_source

    config = load_config(config_path)
    return config, run_health(config, select_source(config, source), node=node)


def _broken(err: TorchpassError, exit_code: int) -> NoReturn:
    """The check could not even start (bad config): say so and exit with ``exit_code``."""
    render_error(err)
    raise SystemExit(exit_code)


@click.group("health")
def health() -> None:
    """Node health checks (GPUs, memory, disk) and the Slurm hooks that drain bad nodes."""


@health.command("check")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report instead of a table.")
@config_option
@source_option
@node_option
@pass_app
def check(app: App, as_json: bool, config_path: str | None, source: str | None, node: str | None) -> None:
    """Check this node once; exit 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN (the check broke)."""
    try:
        _, report = _evaluate(config_path, source, node)
    except TorchpassError as err:
        if as_json:
            click.echo(json.dumps({"status": "UNKNOWN", "exit_code": 3, "error": err.message}, indent=2))
        _broken(err, 3)
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2))
    else:
        _print_report(app, report)
    raise SystemExit(int(report.status))


def _print_report(app: App, report: HealthReport) -> None:
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE, show_edge=False)
    for column in ("STATUS", "CHECK", "GPU", "MESSAGE"):
        table.add_column(column, overflow="fold")
    for r in report.results:
        gpu = "" if r.gpu is None else str(r.gpu)
        table.add_row(f"[{_STYLE[r.status.name]}]{r.status.name}[/]", r.check, gpu, r.message)
    app.console.print(table)
    status = report.status.name
    app.console.print(
        f"{report.node}: [{_STYLE[status]}]{status}[/] (source {report.source}, {report.duration_s:.2f} s)"
    )


def _hook(
    config_path: str | None,
    source: str | None,
    node: str | None,
    decide: Callable[[HealthConfig, HealthReport], tuple[int, str | None]],
    broken_exit: int,
) -> NoReturn:
    """Shared shell of the Slurm hooks: quiet unless there is something to say."""
    try:
        config, report = _evaluate(config_path, source, node)
    except ConfigError as err:
        notify(f"torchpass: health check not run: {err.message} (node not drained)")
        raise SystemExit(broken_exit) from err
    except Exception as err:  # deliberately broad: a bug in the check must not drain the node or fail a job
        prog, *argv = click.get_current_context().command_path.split()
        log = write_traceback(err, prog, argv)
        where = f"traceback in {log}" if log is not None else "the traceback could not be written"
        notify(f"torchpass: health check broke: {type(err).__name__}: {err}; {where} (node not drained)")
        raise SystemExit(broken_exit) from err
    code, message = decide(config, report)
    if message:
        notify(message)
    raise SystemExit(code)


def _prolog_decision(config: HealthConfig, report: HealthReport) -> tuple[int, str | None]:
    from torchpass_slurm.health.admin import prolog

    outcome = prolog(report, config, lambda: slurm_backend(config.slurm_timeout_s))
    return outcome.exit_code, outcome.message


@health.command("prolog")
@config_option
@source_option
@node_option
def prolog_command(config_path: str | None, source: str | None, node: str | None) -> None:
    """Slurm Prolog: on CRITICAL drain this node ("torchpass: ...") and exit 1; else exit 0, quietly."""
    _hook(config_path, source, node, _prolog_decision, broken_exit=0)


@health.command("epilog")
@config_option
@source_option
@node_option
def epilog_command(config_path: str | None, source: str | None, node: str | None) -> None:
    """Slurm Epilog: the same as the prolog, after a job (a bad node gets no next job)."""
    _hook(config_path, source, node, _prolog_decision, broken_exit=0)


def _node_check_decision(config: HealthConfig, report: HealthReport) -> tuple[int, str | None]:
    from torchpass_slurm.health.admin import node_check

    outcome = node_check(report, config, lambda: slurm_backend(config.slurm_timeout_s), now=clock())
    return outcome.exit_code, outcome.message


@health.command("node-check")
@config_option
@source_option
@node_option
def node_check_command(config_path: str | None, source: str | None, node: str | None) -> None:
    """Slurm HealthCheckProgram: drain this node on CRITICAL; resume it when OK if auto_resume is set."""
    _hook(config_path, source, node, _node_check_decision, broken_exit=3)


@health.command("install")
@click.option(
    "--write",
    "write_dir",
    metavar="DIR",
    type=click.Path(file_okay=False),
    help="Write the files into DIR (they are only shown otherwise).",
)
@click.option("--force", is_flag=True, help="With --write: replace files that exist.")
@click.option(
    "--tp", "tp_path", metavar="PATH", default=None, help="The tp the wrappers run (default: this tp's path)."
)
@click.option("--script-dir", default="/etc/slurm", show_default=True, help="Where the wrappers will live.")
@click.option(
    "--interval",
    default=300,
    show_default=True,
    type=click.IntRange(min=1),
    help="HealthCheckInterval, seconds.",
)
def install(write_dir: str | None, force: bool, tp_path: str | None, script_dir: str, interval: int) -> None:
    """Show (or --write) the slurm.conf lines, a config template and the wrapper scripts."""
    from torchpass_slurm.health.install import InstallPaths, install_files

    paths = InstallPaths(tp=tp_path or _this_tp(), script_dir=script_dir, health_check_interval=interval)
    files = install_files(paths)
    if write_dir is None:
        for f in files:
            click.echo(f"==> {f.name}  (install as {f.destination})")
            click.echo(f.text)
        return
    _write_files(Path(write_dir), files, force=force)


def _this_tp() -> str:
    import shutil

    found = shutil.which("tp")
    return str(Path(found).resolve()) if found else "/usr/local/bin/tp"


def _write_files(folder: Path, files: list[InstallFile], *, force: bool) -> None:
    existing = [f.name for f in files if (folder / f.name).exists()]
    if existing and not force:
        raise ConfigError(
            f"{folder} already holds {', '.join(existing)}; nothing was written",
            hint="pass --force to replace them, or choose another folder",
        )
    folder.mkdir(parents=True, exist_ok=True)
    for f in files:
        target = folder / f.name
        target.write_text(f.text)
        target.chmod(f.mode)
        click.echo(f"wrote {target}  (install as {f.destination})")


@health.command("undrain")
@click.option("--dry-run", is_flag=True, help="Only show what would be resumed.")
@click.argument("nodes", nargs=-1)
@pass_app
def undrain_command(app: App, dry_run: bool, nodes: tuple[str, ...]) -> None:
    """Resume nodes drained with a "torchpass:" reason (all, or those of NODES hostlists); skip the rest."""
    from torchpass_slurm.health.drain import plan_undrain, undrain
    from torchpass_slurm.slurm import expand

    wanted = [name for expr in nodes for name in expand(expr)] or None
    slurm = slurm_backend()
    steps = plan_undrain(slurm.nodes(wanted), wanted)
    if not steps:
        click.echo("no drained nodes")
        return
    undrain(slurm, steps, dry_run=dry_run)
    verb = "would resume" if dry_run else "resumed"
    for step in steps:
        if step.action == "resume":
            click.echo(f"{verb} {step.node} (reason was: {step.reason})")
        else:
            shown = f": {step.reason}" if step.reason else ""
            click.echo(f"skipped {step.node}: {step.why}{shown}")
