"""Parse ``scontrol -o show job`` / ``scontrol -o show node`` text (one record a line).

A fallback for when JSON is not wanted or not available (``scontrol --json``
needs 23.02+). A record is ``Key=value`` pairs separated by blanks, but values
may contain blanks themselves (``OS=Linux 6.1 #1 SMP``, ``Reason=tp: planned
maintenance [root@...]``): a word that does not start with ``Key=`` continues
the previous value. In a NODE record ``Reason=`` comes last and runs to the end
of the line (a reason may contain anything); in a JOB record ``Reason=`` is a
single word in the middle.
"""

from __future__ import annotations

import re
from datetime import datetime

from torchpass_slurm.errors import SlurmParseError
from torchpass_slurm.slurm.models import Job, Node
from torchpass_slurm.slurm.parse import expand_nodelist, split_state

__all__ = ["parse_records", "parse_scontrol_job", "parse_scontrol_nodes"]

_KEY = re.compile(r"^([A-Za-z][A-Za-z0-9_:/]*)=(.*)$")

# Old scontrol/sinfo suffixes standing for a flag (``IDLE*`` = not responding).
_SUFFIX_FLAGS = {
    "*": "NOT_RESPONDING",
    "~": "POWERED_DOWN",
    "#": "POWERING_UP",
    "%": "POWERING_DOWN",
    "$": "MAINTENANCE",
    "@": "REBOOT_REQUESTED",
    "!": "POWER_DOWN",
    "^": "REBOOT_ISSUED",
}

_NULL = {"", "(null)", "None", "N/A"}


def parse_records(
    text: str, what: str = "scontrol -o output", *, tail_key: str | None = None
) -> list[dict[str, str]]:
    """Each non-empty line as a dict of its ``Key=value`` pairs.

    ``tail_key=`` (if given) takes everything after it, to the end of the line.
    """
    return [_parse_line(line, what, tail_key) for line in text.splitlines() if line.strip()]


def _parse_line(line: str, what: str, tail_key: str | None) -> dict[str, str]:
    record: dict[str, str] = {}
    key: str | None = None
    rest = line.strip()
    tail_at = re.search(rf"(?:^|\s){tail_key}=", rest) if tail_key else None
    if tail_key and tail_at is not None:
        record[tail_key] = rest[tail_at.end() :].strip()
        rest = rest[: tail_at.start()]
    for word in rest.split():
        match = _KEY.match(word)
        if match:
            key = match.group(1)
            record[key] = match.group(2)
        elif key is None:
            raise SlurmParseError(what, f"expected Key=value, got {word!r}", excerpt=line)
        else:
            record[key] = f"{record[key]} {word}"
    return record


def _get(record: dict[str, str], key: str, what: str) -> str:
    if key not in record:
        raise SlurmParseError(
            what, f"missing {key}=", excerpt=" ".join(f"{k}={v}" for k, v in record.items())
        )
    return record[key]


def _opt(record: dict[str, str], key: str) -> str | None:
    value = record.get(key, "")
    return None if value in _NULL else value


def parse_scontrol_job(text: str) -> Job:
    """The job in ``scontrol -o show job ID`` output."""
    what = "scontrol show job output"
    records = parse_records(text, what)
    if len(records) > 1 and len({r.get("HetJobId") for r in records} - {None, ""}) == 1:
        # a heterogeneous job's leader lists every component: the id names component 0
        records = [r for r in records if r.get("HetJobOffset") == "0"] or records
    if len(records) != 1:
        raise SlurmParseError(what, f"expected one job, got {len(records)}", excerpt=text)
    rec = records[0]
    job_id = _get(rec, "JobId", what)
    if not job_id.isdigit():
        raise SlurmParseError(what, f"JobId={job_id!r} is not a number", excerpt=text)
    state, flags = split_state(_get(rec, "JobState", what), what)
    num_nodes = _opt(rec, "NumNodes")
    return Job(
        job_id=int(job_id),
        name=rec.get("JobName", ""),
        state=state,
        flags=flags,
        nodes=expand_nodelist(_get(rec, "NodeList", what), what),
        batch_host=_opt(rec, "BatchHost"),
        partition=_opt(rec, "Partition"),
        reason=_opt(rec, "Reason"),
        num_nodes=int(num_nodes) if num_nodes and num_nodes.isdigit() else None,
        comment=_opt(rec, "Comment"),
        std_out=_opt(rec, "StdOut"),
        work_dir=_opt(rec, "WorkDir"),
    )


def parse_scontrol_nodes(text: str) -> tuple[Node, ...]:
    """The nodes in ``scontrol -o show node [NAME]`` output."""
    what = "scontrol show node output"
    return tuple(_node(rec, what) for rec in parse_records(text, what, tail_key="Reason"))


def _node(rec: dict[str, str], what: str) -> Node:
    raw = _get(rec, "State", what)
    suffix = {_SUFFIX_FLAGS[c] for c in raw if c in _SUFFIX_FLAGS}
    state, flags = split_state(raw.rstrip("".join(_SUFFIX_FLAGS)), what)
    cpus = _opt(rec, "CPUTot")
    reason = _opt(rec, "Reason")
    if reason:
        reason = re.sub(r"\s*\[[^\]]*@[^\]]*\]$", "", reason)  # drop " [user@time]"
    partitions = _opt(rec, "Partitions")
    return Node(
        name=_get(rec, "NodeName", what),
        state=state,
        flags=flags | suffix,
        reason=reason or None,
        partitions=tuple(partitions.split(",")) if partitions else (),
        cpus=int(cpus) if cpus and cpus.isdigit() else None,
        slurmd_started=_local_time(_opt(rec, "SlurmdStartTime")),
    )


def _local_time(text: str | None) -> float | None:
    """``2026-12-06T00:03:14`` (scontrol prints the caller's local time) as epoch seconds, or
    None when Slurm gives none (``None``, ``Unknown``) or something else."""
    if not text:
        return None
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None
