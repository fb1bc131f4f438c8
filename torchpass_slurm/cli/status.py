"""``tp status``: the job's present state, from the supervisor's ``RUN_DIR/status.json``.

The pure part (ages, rank ranges, the JSON document, the rich renderable) is
separate from the command so that it is tested with a fixed ``now``. rich is
imported only inside functions: ``tp --help`` stays instant.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from torchpass_slurm.cli.app import App, pass_app
from torchpass_slurm.cli.poll import poll_until
from torchpass_slurm.config import NodeRole, SupervisorConfig
from torchpass_slurm.rundir.locate import find_run_dir
from torchpass_slurm.rundir.status import STATUS_FILE, JobStatus, NodeStatus, read_status

if TYPE_CHECKING:
    from rich.console import RenderableType

logger = logging.getLogger(__name__)

#: Supervisor states after which nothing changes any more (``--watch`` stops).
FINAL_STATES = frozenset({"succeeded", "failed"})
#: A status file older than this (seconds) while the job is not final means the
#: supervisor stopped writing it: it is gone, or hung. It rewrites it about once a second.
STALE_STATUS_S = 30.0
#: Heartbeat ages (seconds) shown in yellow / red: silent past the suspicion threshold
#: (plus the status file's one-second refresh) / past the timeout that declares it lost.
HEARTBEAT_WARN_S = SupervisorConfig.silence_threshold + 1.0
HEARTBEAT_BAD_S = SupervisorConfig.heartbeat_timeout
#: Roles whose nodes are expected to send heartbeats.
LIVE_ROLES = frozenset({NodeRole.ACTIVE, NodeRole.SPARE})
#: Default seconds between refreshes of ``--watch``.
WATCH_INTERVAL_S = 2.0

#: The clock ages are measured against (unix seconds); tests replace it.
clock: Callable[[], float] = time.time


# --- pure helpers -------------------------------------------------------------


def compact_ranks(ranks: Iterable[int]) -> str:
    """``(0, 1, 2, 3, 8, 10, 11)`` -> ``"0-3,8,10-11"``; no ranks -> ``"-"``."""
    ordered = sorted(set(ranks))
    if not ordered:
        return "-"
    runs: list[list[int]] = []
    for rank in ordered:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def format_age(seconds: float | None) -> str:
    """A short age: ``"1.2s"``, ``"42s"``, ``"3m05s"``, ``"2h07m"``; None -> ``"-"``."""
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)  # a clock a little ahead of ours is not the future
    if seconds < 10:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def heartbeat_age(node: NodeStatus, now: float) -> float | None:
    """Seconds since the node's last heartbeat, or None if it never sent one."""
    return None if node.last_heartbeat is None else now - node.last_heartbeat


def heartbeat_style(node: NodeStatus, age: float | None) -> str:
    """rich style of a heartbeat age: red once lost, yellow after missed beats."""
    if age is None or node.role not in LIVE_ROLES:
        return ""
    if age >= HEARTBEAT_BAD_S:
        return "red"
    if age >= HEARTBEAT_WARN_S:
        return "yellow"
    return ""


def is_stale(status: JobStatus, now: float) -> bool:
    """The supervisor stopped updating a job that has not finished."""
    return status.state not in FINAL_STATES and now - status.updated > STALE_STATUS_S


def status_as_json(status: JobStatus, now: float) -> str:
    """The ``--json`` document: status.json plus ``status_age`` and each node's ``heartbeat_age``."""
    data = json.loads(status.to_json())
    data["status_age"] = round(now - status.updated, 3)
    for entry, node in zip(data["nodes"], status.nodes, strict=True):
        age = heartbeat_age(node, now)
        entry["heartbeat_age"] = None if age is None else round(age, 3)
    return json.dumps(data, indent=2, sort_keys=True)


def header_line(status: JobStatus, now: float) -> str:
    """``job 4242  running  epoch 2  world size 8  restarts 0  status 1.0s old``, with
    ``transport mpi`` before ``status`` when the job's transport is not ``auto``."""
    transport = f"transport {status.transport}  " if status.transport != "auto" else ""
    return (
        f"job {status.job_id}  {status.state}  epoch {status.epoch}  world size {status.world_size}  "
        f"restarts {status.restarts}  {transport}status {format_age(now - status.updated)} old"
    )


def render_status(status: JobStatus, now: float) -> RenderableType:
    """The header, the message, a staleness warning and one table row per node."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[RenderableType] = [Text(header_line(status, now), style="bold")]
    if status.message:
        parts.append(Text(status.message))
    if status.holding:
        left = format_age(max(0.0, (status.holding_until or now) - now))
        parts.append(
            Text(
                f"holding the committed step for a spare to replace {', '.join(status.holding)} "
                f"(up to {left} more)",
                style="yellow",
            )
        )
    if is_stale(status, now):
        parts.append(
            Text(
                f"warning: no update for {format_age(now - status.updated)}: the supervisor is gone or hung "
                "(see `squeue`, the job's output)",
                style="yellow",
            )
        )
    table = Table(box=box.SIMPLE, show_edge=False)
    for column in ("NODE", "ROLE", "RANKS", "STATE", "STEP", "HEARTBEAT", "EXIT"):
        table.add_column(column, overflow="fold")
    for node in status.nodes:
        age = heartbeat_age(node, now)
        table.add_row(
            node.node,
            node.role,
            compact_ranks(node.ranks),
            node.state,
            "-" if node.last_step is None else str(node.last_step),
            Text(format_age(age), style=heartbeat_style(node, age)),
            "-" if node.exit_code is None else str(node.exit_code),
        )
    parts.append(table)
    return Group(*parts)


# --- the command --------------------------------------------------------------


def _waiting(run_dir: Path) -> RenderableType:
    from rich.text import Text

    return Text(f"waiting for {run_dir / STATUS_FILE} (the job may not have started yet)")


def watch(app: App, run_dir: Path, interval: float) -> None:
    """Redraw the status every ``interval`` seconds until it is final or Ctrl-C.

    On a terminal the table is redrawn in place; into a pipe each snapshot is
    printed after the last.
    """
    if not app.console.is_terminal:
        _watch_loop(run_dir, interval, app.console.print)
        return
    from rich.live import Live

    with Live(console=app.console, auto_refresh=False) as live:
        _watch_loop(run_dir, interval, lambda shown: live.update(shown, refresh=True))


def _watch_loop(run_dir: Path, interval: float, show: Callable[[RenderableType], None]) -> None:
    def step() -> bool:
        if not (run_dir / STATUS_FILE).exists():
            show(_waiting(run_dir))
            return False
        current = read_status(run_dir)
        show(render_status(current, clock()))
        return current.state in FINAL_STATES

    poll_until(step, interval)


@click.command("status")
@click.argument("job_or_run_dir", metavar="JOB_OR_RUN_DIR")
@click.option("--json", "as_json", is_flag=True, help="Print status.json with heartbeat ages, as JSON.")
@click.option("-w", "--watch", "watching", is_flag=True, help="Redraw until the job ends (Ctrl-C to stop).")
@click.option(
    "-i",
    "--interval",
    type=click.FloatRange(min=0.1),
    default=WATCH_INTERVAL_S,
    show_default=True,
    metavar="S",
    help="Seconds between redraws of --watch.",
)
@pass_app
def status(app: App, job_or_run_dir: str, as_json: bool, watching: bool, interval: float) -> None:
    """Show a job's nodes, roles, ranks, steps and heartbeats.

    JOB_OR_RUN_DIR is a Slurm job id submitted with tp-submit, or the job's run folder.
    """
    if as_json and watching:
        raise click.UsageError("--json and --watch cannot be combined")
    run_dir = find_run_dir(job_or_run_dir)
    if watching:
        watch(app, run_dir, interval)
        return
    current = read_status(run_dir)
    from torchpass_slurm.rundir.supervisor_lost import read_record

    lost = read_record(run_dir)
    if as_json:
        data = json.loads(status_as_json(current, clock()))
        data["supervisor_lost"] = lost
        click.echo(json.dumps(data, indent=2, sort_keys=True))
        return
    app.console.print(render_status(current, clock()))
    if lost is not None:
        app.console.print(
            f"[red]the job ended because its supervisor was lost: {lost.get('detail', '')}[/red]"
        )
