"""Totals over the faults of one or more jobs, and the forms ``tp report`` prints.

Pure: :func:`summarise` totals the :class:`~torchpass_slurm.analysis.report.JobReport`
of each job per resolution, per fault class and over all; :func:`summary_line`
and :func:`spare_line` say it in a line; :func:`job_json`, :func:`report_json`
and :func:`summary_json` are the machine forms (``tp report --json``). How a
fault, its class and its recovery are read from the log, and how steps are
totalled (each recovery once, in the class of its first fault), are the rules
of :mod:`torchpass_slurm.analysis.report`. Nothing here reads files or imports rich.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torchpass_slurm.analysis.report import CLASSES, RESOLUTIONS, FaultRecord, JobReport

__all__ = [
    "ClassSummary",
    "Summary",
    "Totals",
    "format_percent",
    "job_json",
    "report_json",
    "spare_line",
    "summarise",
    "summary_json",
    "summary_line",
]

#: How each resolution reads in the summary line.
RESOLUTION_PHRASES: Mapping[str | None, str] = {
    "live": "resolved by live migration",
    "checkpoint": "resolved by checkpoint restart",
    "regroup": "resolved by rebuilding the group",
    "deferred": "deferred to the end of the job",
    "fatal": "was fatal",
    None: "is unresolved in the log",
}
#: The verbs of those phrases for more than one fault.
PLURAL_VERBS: Mapping[str, str] = {"was": "were", "is": "are"}
#: Classes whose summary leaves out the lost steps when none is known (there is nothing to say).
QUIET_WHEN_UNKNOWN = frozenset({"fatal", None})


# --- results ------------------------------------------------------------------


@dataclass(frozen=True)
class Totals:
    """Counts of a group of faults (one resolution, one class, all); step sums over its recoveries."""

    faults: int = 0
    recoveries: int = 0
    lost_steps: int = 0
    lost_steps_unknown: int = 0
    recomputed_steps: int = 0
    recomputed_steps_unknown: int = 0


@dataclass(frozen=True)
class ClassSummary:
    """One fault class, or all of them: totals, faults with no lost progress, faults per resolution."""

    totals: Totals
    no_lost_progress: int
    by_resolution: Mapping[str | None, int]

    @property
    def share_no_lost_progress(self) -> float | None:
        """no_lost_progress / faults; None without faults."""
        return self.no_lost_progress / self.totals.faults if self.totals.faults else None


@dataclass(frozen=True)
class Summary:
    """Totals over one or more jobs: per resolution, per fault class, over all."""

    by_resolution: Mapping[str | None, Totals]
    by_class: Mapping[str, ClassSummary]
    total: ClassSummary
    spare_faults: int

    @property
    def faults(self) -> int:
        """Faults of every class."""
        return self.total.totals.faults

    @property
    def no_lost_progress(self) -> int:
        """Faults of every class whose recovery lost no committed step."""
        return self.total.no_lost_progress

    @property
    def share_no_lost_progress(self) -> float | None:
        """no_lost_progress / faults; None without faults."""
        return self.total.share_no_lost_progress


# --- totals -------------------------------------------------------------------


def summarise(reports: Iterable[JobReport]) -> Summary:
    """Totals per resolution, per fault class and over all the jobs; steps count once per recovery."""
    reports = list(reports)
    faults = [f for r in reports for f in r.faults]
    # A recovery's first fault stands for it: its steps count once, in that fault's class.
    firsts = list({(id(r), f.recovery): f for r in reports for f in reversed(r.faults)}.values())
    by_resolution = {
        res: _totals(*_where(faults, firsts, "resolution", res))
        for res in _ordered({f.resolution for f in faults}, RESOLUTIONS)
    }
    by_class = {
        c: _class_summary(*_where(faults, firsts, "fault_class", c))
        for c in _ordered({f.fault_class for f in faults}, CLASSES)
    }
    return Summary(
        by_resolution=by_resolution,
        by_class=by_class,
        total=_class_summary(faults, firsts),
        spare_faults=sum(len(r.spare_faults) for r in reports),
    )


def _where(
    faults: Sequence[FaultRecord], firsts: Sequence[FaultRecord], attribute: str, value: Any
) -> tuple[list[FaultRecord], list[FaultRecord]]:
    """The faults, and the recoveries' first faults, whose ``attribute`` is ``value``."""
    return (
        [f for f in faults if getattr(f, attribute) == value],
        [f for f in firsts if getattr(f, attribute) == value],
    )


def _ordered(present: set[Any], order: Sequence[Any]) -> list[Any]:
    """``present`` in the reporting ``order``, any others after them by name."""
    return [x for x in order if x in present] + sorted(present - set(order), key=str)


def _class_summary(faults: Sequence[FaultRecord], recoveries: Sequence[FaultRecord]) -> ClassSummary:
    resolutions = [f.resolution for f in faults]
    return ClassSummary(
        totals=_totals(faults, recoveries),
        no_lost_progress=sum(f.lost_steps == 0 for f in faults),
        by_resolution={res: resolutions.count(res) for res in _ordered(set(resolutions), RESOLUTIONS)},
    )


def _totals(faults: Sequence[FaultRecord], recoveries: Sequence[FaultRecord]) -> Totals:
    """The faults, and the step sums of the recoveries (each given by its first fault)."""
    lost = [f.lost_steps for f in recoveries]
    recomputed = [f.recomputed_steps for f in recoveries]
    return Totals(
        faults=len(faults),
        recoveries=len(recoveries),
        lost_steps=sum(n for n in lost if n is not None),
        lost_steps_unknown=lost.count(None),
        recomputed_steps=sum(n for n in recomputed if n is not None),
        recomputed_steps_unknown=recomputed.count(None),
    )


# --- text ---------------------------------------------------------------------


def summary_line(summary: Summary) -> str:
    """One line, such as:

    ``2 of 2 faults resolved by live migration with 0 committed steps lost (100% with no lost progress)``
    """
    if not summary.faults:
        return "no faults on active nodes"
    noun = "fault" if summary.faults == 1 else "faults"
    parts = []
    for i, (resolution, totals) in enumerate(summary.by_resolution.items()):
        head = f"{totals.faults} of {summary.faults} {noun}" if i == 0 else str(totals.faults)
        parts.append(f"{head} {_phrase(resolution, totals.faults)}{_lost_phrase(resolution, totals)}")
    share = summary.share_no_lost_progress or 0.0
    return "; ".join(parts) + f" ({format_percent(share)} with no lost progress)"


def _phrase(resolution: str | None, faults: int) -> str:
    """The resolution's phrase, its verb agreeing with the number of faults (``was`` -> ``were``)."""
    phrase = RESOLUTION_PHRASES.get(resolution, f"resolved as {resolution}")
    verb, rest = phrase.split(" ", 1)
    return f"{PLURAL_VERBS.get(verb, verb)} {rest}" if faults != 1 else phrase


def spare_line(spare_faults: int) -> str | None:
    """``1 spare lost on standby (no progress lost)``; None when no spare failed."""
    if not spare_faults:
        return None
    noun = "spare" if spare_faults == 1 else "spares"
    return f"{spare_faults} {noun} lost on standby (no progress lost)"


def _lost_phrase(resolution: str | None, totals: Totals) -> str:
    """`` with 3 committed steps lost``; the unknown ones are said, never counted as 0."""
    if totals.lost_steps_unknown == totals.recoveries:
        return "" if resolution in QUIET_WHEN_UNKNOWN else " with an unknown number of committed steps lost"
    text = f" with {totals.lost_steps} committed {'step' if totals.lost_steps == 1 else 'steps'} lost"
    if totals.lost_steps_unknown:
        text += f" (unknown for {totals.lost_steps_unknown} of {totals.recoveries} recoveries)"
    return text


def format_percent(share: float | None) -> str:
    """``67%`` (half up); None -> ``-``."""
    return "-" if share is None else f"{math.floor(share * 100 + 0.5)}%"


# --- JSON ---------------------------------------------------------------------


def job_json(report: JobReport) -> dict[str, Any]:
    """One job's document: ``job``, ``run_dir``, ``faults[]``, ``spare_faults[]``, ``summary{}``."""
    return {
        "job": report.job,
        "run_dir": report.source,
        "faults": [{"index": i, **f.as_dict()} for i, f in enumerate(report.faults, 1)],
        "spare_faults": [s.as_dict() for s in report.spare_faults],
        "summary": summary_json(summarise([report])),
    }


def report_json(reports: Sequence[JobReport], *, totals_only: bool = False) -> dict[str, Any]:
    """One job: its document; several: ``{"jobs": [...], "totals": summary}``.

    ``totals_only``: ``{"totals": summary}``, whatever the number of jobs.
    """
    if totals_only:
        return {"totals": summary_json(summarise(reports))}
    if len(reports) == 1:
        return job_json(reports[0])
    return {"jobs": [job_json(r) for r in reports], "totals": summary_json(summarise(reports))}


def summary_json(summary: Summary) -> dict[str, Any]:
    """Counts, the no-lost-progress share, and totals per resolution (``unresolved`` for None),
    per fault class (``by_class``) and over all classes (``total``)."""
    share = summary.share_no_lost_progress
    return {
        "faults": summary.faults,
        "no_lost_progress": summary.no_lost_progress,
        "no_lost_progress_share": _round_share(share),
        **_steps_json(summary.total.totals),
        "spare_faults": summary.spare_faults,
        "by_resolution": {
            _resolution_key(res): {"faults": totals.faults, **_steps_json(totals)}
            for res, totals in summary.by_resolution.items()
        },
        "by_class": {name: _class_json(c) for name, c in summary.by_class.items()},
        "total": _class_json(summary.total),
        "text": summary_line(summary),
    }


def _class_json(summary: ClassSummary) -> dict[str, Any]:
    """``events``, ``no_lost_progress`` and its share, ``resolutions{}`` (counts), and the step sums."""
    return {
        "events": summary.totals.faults,
        "no_lost_progress": summary.no_lost_progress,
        "no_lost_progress_share": _round_share(summary.share_no_lost_progress),
        "resolutions": {_resolution_key(res): n for res, n in summary.by_resolution.items()},
        **_steps_json(summary.totals),
    }


def _steps_json(totals: Totals) -> dict[str, int | None]:
    """Step sums over the recoveries that report them (null when none does), and how many do not."""
    known = totals.recoveries - totals.lost_steps_unknown, totals.recoveries - totals.recomputed_steps_unknown
    return {
        "recoveries": totals.recoveries,
        "lost_steps": totals.lost_steps if known[0] else None,
        "lost_steps_unknown": totals.lost_steps_unknown,
        "recomputed_steps": totals.recomputed_steps if known[1] else None,
        "recomputed_steps_unknown": totals.recomputed_steps_unknown,
    }


def _resolution_key(resolution: str | None) -> str:
    return "unresolved" if resolution is None else resolution


def _round_share(share: float | None) -> float | None:
    return None if share is None else round(share, 4)
