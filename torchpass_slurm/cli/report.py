"""``tp report``: every fault of a job, how it was resolved, and where the recovery time went.

The analysis of a job is :mod:`torchpass_slurm.analysis.report` (pure, its docstring
states the rules), the totals over jobs :mod:`torchpass_slurm.analysis.report_totals`;
this module finds the run folders (a folder of run folders stands for all of
them: a fleet), reads the event logs and draws the tables, and with ``--explain``
the :data:`LEGEND` under them (the same text is in docs/user-guide.md). rich is
imported only inside functions: ``tp --help`` stays instant.
"""

from __future__ import annotations

import json
import logging
import textwrap
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from torchpass_slurm.analysis.report import JobReport, analyse
from torchpass_slurm.analysis.report_totals import (
    ClassSummary,
    Summary,
    Totals,
    format_percent,
    report_json,
    spare_line,
    summarise,
    summary_line,
)
from torchpass_slurm.cli.app import App, pass_app
from torchpass_slurm.errors import EventLogError, RunDirError
from torchpass_slurm.rundir.events import EVENTS_FILE, read_events
from torchpass_slurm.rundir.locate import find_run_dir, is_run_dir, run_dirs_in

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from rich.table import Table

logger = logging.getLogger(__name__)

#: Columns of the per-fault table.
FAULT_COLUMNS = (
    "#",
    "TIME",
    "CLASS",
    "NODE",
    "DETECTOR",
    "RESOLUTION",
    "LOST",
    "RECOMPUTED",
    "DETECT",
    "DECIDE",
    "REBUILD",
    "AGREE",
    "TRANSFER",
    "FIRST STEP",
    "TOTAL",
)
#: Columns of the totals per fault class (several jobs).
CLASS_COLUMNS = (
    "CLASS",
    "EVENTS",
    "NO LOST PROGRESS",
    "SHARE",
    "LIVE",
    "CHECKPOINT",
    "OTHER",
    "LOST",
    "RECOMPUTED",
)
#: Columns of the totals per resolution (several jobs).
TOTAL_COLUMNS = ("RESOLUTION", "FAULTS", "RECOVERIES", "LOST", "RECOMPUTED")
#: Width a table is measured in before it is printed (wider than any table).
UNBOUNDED_WIDTH = 10_000

#: How to read the tables: printed under them with ``--explain`` (and in docs/user-guide.md).
LEGEND = (
    "A fault is unplanned (the first detection -- heartbeat_lost, rank_hung, node_down, step_exited "
    "with exit code "
    "!= 0 -- of an active node; more in one recovery count once), pre-emptive (a drain after the node's "
    'health_warning, or with the reason "torchpass: pre-emptive") or planned (another drain); a drain '
    "counts once migrated (migration_started mode=planned) or deferred (drain_deferred: nothing lost). "
    "Resolution: deferred, else migration_done.resolution, else restarted from a checkpoint -> "
    "checkpoint, else failed -> fatal. Phases (s): detect = last heartbeat -> detected (none for a "
    "drain, detected at drain_seen or health_warning), decide = -> migration_started, rebuild = -> last "
    "group_rebuilt, agree = -> agreement, transfer = -> last transfer_done, first step = -> first_step; "
    "total = detected -> first_step; - = not in the log. Lost = committed steps lost "
    "(migration_done.lost_steps), unknown when the log does not say; lost and recomputed steps are per "
    "recovery, in the class of its first fault. No lost progress = lost == 0, per class and over all. "
    "Spare faults cost no progress. Times are UTC."
)


def load_reports(args: Sequence[str]) -> list[JobReport]:
    """The report of every job named: a job id, a run folder, or a folder of run folders (a fleet).

    A run folder named by hand must have a readable event log; in a fleet, one
    without a readable event log is skipped with a warning. A run folder named
    twice is reported once.
    """
    reports: list[JobReport] = []
    seen: set[Path] = set()
    for arg in args:
        folder = Path(arg).expanduser()
        fleet = folder.is_dir() and not is_run_dir(folder)
        for run_dir in run_dirs_in(folder) if fleet else [find_run_dir(arg)]:
            if run_dir.resolve() in seen:
                continue
            seen.add(run_dir.resolve())
            report = load_fleet_member(run_dir) if fleet else load_report(run_dir)
            if report is not None:
                reports.append(report)
    if not reports:
        raise RunDirError(
            f"none of the run folders found has a readable event log ({len(seen)} skipped)",
            hint=f"a job that has not started has no {EVENTS_FILE} yet; see the warnings above",
        )
    return reports


def load_report(run_dir: Path) -> JobReport:
    """Read a run folder's event log and analyse it."""
    return analyse(read_events(run_dir / EVENTS_FILE, strict=True), source=str(run_dir))


def load_fleet_member(run_dir: Path) -> JobReport | None:
    """:func:`load_report`, or None with a warning on stderr when the event log cannot be read."""
    if not (run_dir / EVENTS_FILE).is_file():
        click.echo(f"warning: skipping {run_dir}: it has no {EVENTS_FILE}", err=True)
        return None
    try:
        return load_report(run_dir)
    except EventLogError as err:
        click.echo(f"warning: skipping {run_dir}: {err.message}", err=True)
        return None


def render_job(report: JobReport) -> RenderableType:
    """A job's header, its fault table (if any), the summary line and the spare line."""
    from rich.console import Group
    from rich.text import Text

    parts: list[RenderableType] = [Text(f"job {report.job or '?'}  {report.source}", style="bold")]
    if report.faults:
        parts.append(fault_table(report))
    summary = summarise([report])
    parts.append(Text(summary_line(summary)))
    spares = spare_line(summary.spare_faults)
    if spares:
        nodes = ", ".join(f"{s.node} ({s.detector})" for s in report.spare_faults)
        parts.append(Text(f"{spares}: {nodes}"))
    lost = supervisor_lost_line(Path(report.source))
    if lost:
        parts.append(Text(lost, style="red"))
    return Group(*parts)


def supervisor_lost_line(run_dir: Path) -> str | None:
    """Why the job ended when its supervisor died with its node (``rank/orphan.py``'s record)."""
    from torchpass_slurm.rundir.supervisor_lost import read_record

    record = read_record(run_dir)
    if record is None:
        return None
    return (
        f"the job ended because its supervisor was lost at {format_time(float(record.get('ts', 0)))}: "
        + str(record.get("detail", "no detail"))
    )


def with_supervisor_records(doc: dict[str, Any], reports: Sequence[JobReport]) -> dict[str, Any]:
    """The JSON report with each job's supervisor-lost record (``supervisor_lost``, or null)."""
    from torchpass_slurm.rundir.supervisor_lost import read_record

    jobs: list[dict[str, Any]] = doc.get("jobs", [doc] if "faults" in doc else [])
    for job_doc, report in zip(jobs, reports, strict=False):
        job_doc["supervisor_lost"] = read_record(Path(report.source))
    return doc


def fault_table(report: JobReport) -> Table:
    """One row per fault: when, where, how it was resolved, the steps and the phases."""
    rows = []
    for i, fault in enumerate(report.faults, 1):
        p = fault.phases
        rows.append(
            (
                str(i),
                format_time(fault.ts),
                fault.fault_class,
                fault.node,
                fault.detector,
                (fault.resolution or "unresolved")
                + (f" ({fault.fallback})" if fault.fallback else "")
                + (f" (held {fault.held_s:.0f} s for a spare)" if fault.held_s else ""),
                format_steps(fault.lost_steps),
                format_steps(fault.recomputed_steps),
                *(
                    format_seconds(s)
                    for s in (
                        p.detection,
                        p.decision,
                        p.rebuild,
                        p.agreement,
                        p.transfer,
                        p.first_step,
                        p.total,
                    )
                ),
            )
        )
    return _table(FAULT_COLUMNS, rows, numeric_from=6)


def render_totals(summary: Summary) -> RenderableType:
    """Totals per fault class and per resolution over several jobs, the summary and spare lines."""
    from rich.console import Group
    from rich.text import Text

    parts: list[RenderableType] = [Text("totals", style="bold")]
    if summary.faults:
        parts.append(class_table(summary))
        rows = [
            (resolution or "unresolved", str(t.faults), str(t.recoveries), *_step_cells(t))
            for resolution, t in summary.by_resolution.items()
        ]
        parts.append(_table(TOTAL_COLUMNS, rows, numeric_from=1))
    parts.append(Text(summary_line(summary)))
    spares = spare_line(summary.spare_faults)
    if spares:
        parts.append(Text(spares))
    return Group(*parts)


def class_table(summary: Summary) -> Table:
    """One row per fault class present, then the total over all classes."""
    rows = [_class_row(name, c) for name, c in summary.by_class.items()]
    return _table(CLASS_COLUMNS, rows, numeric_from=1, footer=_class_row("total", summary.total))


def _class_row(name: str, c: ClassSummary) -> tuple[str, ...]:
    live, checkpoint = c.by_resolution.get("live", 0), c.by_resolution.get("checkpoint", 0)
    return (
        name,
        str(c.totals.faults),
        str(c.no_lost_progress),
        format_percent(c.share_no_lost_progress),
        str(live),
        str(checkpoint),
        str(c.totals.faults - live - checkpoint),
        *_step_cells(c.totals),
    )


def sections(reports: Sequence[JobReport], *, totals_only: bool = False) -> list[RenderableType]:
    """Every job's section, then the totals when there are several; only the totals if asked."""
    if totals_only:
        return [render_totals(summarise(reports))]
    parts = [render_job(r) for r in reports]
    if len(reports) > 1:
        parts.append(render_totals(summarise(reports)))
    return parts


def print_report(
    console: Console, reports: Sequence[JobReport], *, totals_only: bool = False, explain: bool = False
) -> None:
    """The sections, each as wide as its table needs, a blank line apart; with ``explain`` the legend."""
    from rich.text import Text

    for i, part in enumerate(sections(reports, totals_only=totals_only)):
        if i:
            console.print()
        print_wide(console, part)
    if explain:
        console.print()
        console.print(Text(textwrap.fill(LEGEND, width=console.width), style="dim"), soft_wrap=True)


def print_wide(console: Console, renderable: RenderableType) -> None:
    """Print at the console's width, or wider when a table needs it: no cell is ever cut.

    A terminal then wraps the long lines; a pipe (where rich assumes 80 columns) gets them whole.
    """
    from rich.measure import Measurement

    needed = Measurement.get(console, console.options.update_width(UNBOUNDED_WIDTH), renderable).maximum
    width = console.width
    console.width = max(width, needed)  # print(width=) would be capped at the console's width
    try:
        console.print(renderable, crop=False)
    finally:
        console.width = width


def _table(
    columns: Sequence[str],
    rows: Sequence[Sequence[str]],
    numeric_from: int,
    footer: Sequence[str] | None = None,
) -> Table:
    """A borderless table; columns from ``numeric_from`` on (and ``#``) are right-aligned.

    A ``footer`` row (totals) is drawn under a line.
    """
    from rich import box
    from rich.table import Table

    table = Table(
        box=box.SIMPLE, show_edge=False, pad_edge=False, show_footer=footer is not None, footer_style="none"
    )
    for i, column in enumerate(columns):
        numeric = i >= numeric_from or column == "#"
        table.add_column(
            column, footer=footer[i] if footer else "", justify="right" if numeric else "left", no_wrap=True
        )
    for row in rows:
        table.add_row(*row)
    return table


def format_time(ts: float) -> str:
    """``05:05:36`` (UTC)."""
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%H:%M:%S")


def format_seconds(seconds: float | None) -> str:
    """``1.25``; None -> ``-``."""
    return "-" if seconds is None else f"{seconds:.2f}"


def format_steps(steps: int | None) -> str:
    """A step count; None -> ``unknown``."""
    return "unknown" if steps is None else str(steps)


def _step_cells(totals: Totals) -> tuple[str, str]:
    """The LOST and RECOMPUTED cells of a totals row."""
    return (
        _steps_total(totals.lost_steps, totals.lost_steps_unknown, totals.recoveries),
        _steps_total(totals.recomputed_steps, totals.recomputed_steps_unknown, totals.recoveries),
    )


def _steps_total(known: int, unknown: int, recoveries: int) -> str:
    """``12``, ``0 + 1 unknown`` (the sum of the known ones), or ``unknown`` (no recovery says)."""
    if unknown and unknown == recoveries:
        return "unknown"
    return f"{known} + {unknown} unknown" if unknown else str(known)


@click.command("report")
@click.argument("jobs_or_run_dirs", metavar="JOB_OR_RUN_DIR...", nargs=-1, required=True)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print faults[] and summary{} as JSON (several jobs: jobs[] and totals{}).",
)
@click.option(
    "--totals-only",
    is_flag=True,
    help="Print only the totals (per fault class and per resolution), not each job.",
)
@click.option("--explain", is_flag=True, help="Print under the report how to read it (the rules).")
@pass_app
def report(
    app: App, jobs_or_run_dirs: tuple[str, ...], as_json: bool, totals_only: bool, explain: bool
) -> None:
    """Show every fault of a job, how it was resolved, and the recovery-time split.

    JOB_OR_RUN_DIR is a Slurm job id submitted with tp-submit, the job's run
    folder, or a folder of run folders (e.g. /shared/runs: every run folder in
    it). With several jobs come totals per fault class (unplanned, pre-emptive,
    planned) and per resolution. Times are UTC; phases are in seconds;
    --explain prints the rules under the report.
    """
    reports = load_reports(jobs_or_run_dirs)
    if as_json:
        doc = with_supervisor_records(report_json(reports, totals_only=totals_only), reports)
        click.echo(json.dumps(doc, indent=2, sort_keys=True))
        return
    print_report(app.console, reports, totals_only=totals_only, explain=explain)
