"""``tp report``: every fault of a job, how it was resolved, and where the recovery time went.

The analysis is :mod:`torchpass_slurm.report` (pure, its docstring states the
rules); this module reads the event logs and draws the tables. rich is
imported only inside functions: ``tp --help`` stays instant.
"""

from __future__ import annotations

import json
import logging
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING

import click

from torchpass_slurm.cli.app import App, pass_app
from torchpass_slurm.events import EVENTS_FILE, read_events
from torchpass_slurm.report import (
    RULES,
    JobReport,
    Summary,
    analyse,
    format_seconds,
    format_steps,
    format_time,
    report_json,
    spare_line,
    summarise,
    summary_line,
)
from torchpass_slurm.rundir import find_run_dir

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from rich.table import Table

logger = logging.getLogger(__name__)

#: Columns of the per-fault table.
FAULT_COLUMNS = ("#", "TIME", "NODE", "DETECTOR", "RESOLUTION", "LOST", "RECOMPUTED",
                 "DETECT", "DECIDE", "REBUILD", "AGREE", "TRANSFER", "FIRST STEP", "TOTAL")
#: Columns of the totals table (several jobs).
TOTAL_COLUMNS = ("RESOLUTION", "FAULTS", "RECOVERIES", "LOST", "RECOMPUTED")
#: Width a table is measured in before it is printed (wider than any table).
UNBOUNDED_WIDTH = 10_000


def load_report(job_or_run_dir: str) -> JobReport:
    """Find the run folder, read its event log and analyse it."""
    run_dir = find_run_dir(job_or_run_dir)
    return analyse(read_events(run_dir / EVENTS_FILE), source=str(run_dir))


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
    return Group(*parts)


def fault_table(report: JobReport) -> Table:
    """One row per fault: when, where, how it was resolved, the steps and the phases."""
    rows = []
    for i, fault in enumerate(report.faults, 1):
        p = fault.phases
        rows.append((
            str(i), format_time(fault.ts), fault.node, fault.detector, fault.resolution or "unresolved",
            format_steps(fault.lost_steps), format_steps(fault.recomputed_steps),
            *(format_seconds(s) for s in (p.detection, p.decision, p.rebuild, p.agreement,
                                          p.transfer, p.first_step, p.total)),
        ))
    return _table(FAULT_COLUMNS, rows, numeric_from=5)


def render_totals(summary: Summary) -> RenderableType:
    """Totals per resolution class over several jobs, and the summary line."""
    from rich.console import Group
    from rich.text import Text

    rows = [
        (resolution or "unresolved", str(t.faults), str(t.recoveries),
         _steps_total(t.lost_steps, t.lost_steps_unknown),
         _steps_total(t.recomputed_steps, t.recomputed_steps_unknown))
        for resolution, t in summary.by_resolution.items()
    ]
    parts: list[RenderableType] = [Text("totals", style="bold")]
    if rows:
        parts.append(_table(TOTAL_COLUMNS, rows, numeric_from=1))
    parts.append(Text(summary_line(summary)))
    spares = spare_line(summary.spare_faults)
    if spares:
        parts.append(Text(spares))
    return Group(*parts)


def sections(reports: Sequence[JobReport]) -> list[RenderableType]:
    """Every job's section, then the totals when there are several."""
    parts = [render_job(r) for r in reports]
    if len(reports) > 1:
        parts.append(render_totals(summarise(reports)))
    return parts


def print_report(console: Console, reports: Sequence[JobReport]) -> None:
    """The sections, each as wide as its table needs, then the rules at the console's width."""
    from rich.text import Text

    for part in sections(reports):
        print_wide(console, part)
        console.print()
    console.print(Text(textwrap.fill(RULES, width=console.width), style="dim"), soft_wrap=True)


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


def _table(columns: Sequence[str], rows: Sequence[Sequence[str]], numeric_from: int) -> Table:
    """A borderless table; columns from ``numeric_from`` on (and ``#``) are right-aligned."""
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE, show_edge=False, pad_edge=False)
    for i, column in enumerate(columns):
        numeric = i >= numeric_from or column == "#"
        table.add_column(column, justify="right" if numeric else "left", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    return table


def _steps_total(known: int, unknown: int) -> str:
    """``12``, ``12 + 1 unknown``, or ``unknown`` (all unknown)."""
    if unknown and not known:
        return "unknown"
    return f"{known} + {unknown} unknown" if unknown else str(known)


@click.command("report")
@click.argument("jobs_or_run_dirs", metavar="JOB_OR_RUN_DIR...", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True, help="Print faults[] and summary{} as JSON.")
@pass_app
def report(app: App, jobs_or_run_dirs: tuple[str, ...], as_json: bool) -> None:
    """Show every fault of a job, how it was resolved, and the recovery-time split.

    JOB_OR_RUN_DIR is a Slurm job id submitted with tp-submit, or the job's run
    folder; give several for one section per job and totals per resolution.
    Times are UTC; phases are in seconds; the rules are printed under the report.
    """
    reports = [load_report(arg) for arg in jobs_or_run_dirs]
    if as_json:
        click.echo(json.dumps(report_json(reports), indent=2, sort_keys=True))
        return
    print_report(app.console, reports)
