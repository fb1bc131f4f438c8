"""``tp events``: the job's event log (``RUN_DIR/events.jsonl``), one line per event.

``--follow`` polls the log (it is small: the whole file is re-read) and prints
what is new, until a ``finished``/``failed`` event or Ctrl-C.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import click

from torchpass_slurm.cli.app import App, pass_app
from torchpass_slurm.cli.poll import poll_until
from torchpass_slurm.rundir.events import EVENTS_FILE, FAILED, FINISHED, Event, read_events
from torchpass_slurm.rundir.locate import find_run_dir

logger = logging.getLogger(__name__)

#: Seconds between reads of the log with ``--follow``.
FOLLOW_INTERVAL_S = 0.5
#: Kinds after which the job writes no more events (``--follow`` stops).
FINAL_KINDS = frozenset({FINISHED, FAILED})


def format_value(value: Any) -> str:
    """A field value for ``key=value``: plain words as they are, anything else as JSON."""
    if isinstance(value, str) and value and not any(c.isspace() or c in '"=' for c in value):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def format_event(event: Event) -> str:
    """``08:42:33.120  e1  spare_promoted  node=s1 replaces=n2`` (time in UTC)."""
    when = datetime.fromtimestamp(event.ts, tz=timezone.utc)
    stamp = when.strftime("%H:%M:%S.") + f"{when.microsecond // 1000:03d}"
    fields = " ".join(f"{key}={format_value(value)}" for key, value in event.fields.items())
    return f"{stamp}  e{event.epoch:<3} {event.kind:<16} {fields}".rstrip()


def event_json(event: Event) -> str:
    """The event's line as the log stores it (without the newline)."""
    return event.to_line().decode("utf-8").rstrip("\n")


def parse_kinds(values: Iterable[str]) -> frozenset[str]:
    """``--kind a --kind b,c`` -> {a, b, c}; empty means every kind."""
    return frozenset(k.strip() for value in values for k in value.split(",") if k.strip())


def select(events: Iterable[Event], kinds: Collection[str]) -> list[Event]:
    """The events of the given kinds (all of them when ``kinds`` is empty)."""
    return [e for e in events if not kinds or e.kind in kinds]


def _print(events: Sequence[Event], as_json: bool) -> None:
    for event in events:
        click.echo(event_json(event) if as_json else format_event(event))


def follow(path: Path, kinds: Collection[str], as_json: bool, interval: float = FOLLOW_INTERVAL_S) -> None:
    """Print events as they are appended, until a final event or Ctrl-C."""
    shown = 0

    def step() -> bool:
        nonlocal shown
        events = read_events(path) if path.exists() else []
        new = events[shown:]
        shown = len(events)
        _print(select(new, kinds), as_json)
        return any(e.kind in FINAL_KINDS for e in new)

    poll_until(step, interval)


@click.command("events")
@click.argument("job_or_run_dir", metavar="JOB_OR_RUN_DIR")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON lines as stored.")
@click.option(
    "-k", "--kind", "kinds", multiple=True, metavar="K", help="Only events of kind K (repeat, or K1,K2)."
)
@click.option(
    "-f",
    "--follow",
    "following",
    is_flag=True,
    help="Keep printing new events until the job finishes or fails (Ctrl-C to stop).",
)
@pass_app
def events(app: App, job_or_run_dir: str, as_json: bool, kinds: tuple[str, ...], following: bool) -> None:
    """Show a job's events: faults, promotions, restarts, the end.

    JOB_OR_RUN_DIR is a Slurm job id submitted with tp-submit, or the job's run folder.
    Times are UTC; `eN` is the membership epoch.
    """
    path = find_run_dir(job_or_run_dir) / EVENTS_FILE
    wanted = parse_kinds(kinds)
    if following:
        follow(path, wanted, as_json)
        return
    found = read_events(path)
    _print(select(found, wanted), as_json)
    if found.skipped:
        lines = ", ".join(map(str, found.skipped[:10])) + (", ..." if len(found.skipped) > 10 else "")
        click.echo(
            f"tp events: skipped {len(found.skipped)} line(s) of {path} that are not events (line {lines})",
            err=True,
        )
