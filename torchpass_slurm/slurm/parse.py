"""Pure parsers for what Slurm prints: JSON of ``sinfo``/``squeue``, ``scontrol -o`` text.

Slurm's JSON changed shape between releases, and these functions accept each
shape they have been tested against (recorded outputs in
``tests/fixtures/slurm/<version>/``):

=====================  ==============================  ================================
                       22.05 (openapi v0.0.38)         24.11 (data_parser v0.0.42)
=====================  ==============================  ================================
``sinfo --json``       ``nodes[]``: one per node,       ``sinfo[]``: one per group of
                       ``state`` a lower-case string,  nodes with the same state and
                       ``state_flags`` a list           partition; ``node.state`` a list
node reason            ``reason`` string               ``reason.description``
``squeue --json``      ``job_state`` a string          ``job_state`` a list
numbers                plain ints                      ``{"set", "infinite", "number"}``
=====================  ==============================  ================================

``scontrol show nodes --json`` (23.02+) has the ``nodes[]`` shape with list
states; it is accepted too. Anything that does not fit raises
:class:`~torchpass_slurm.errors.SlurmParseError` with an excerpt of the output.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from typing import Any

from torchpass_slurm.errors import HostlistError, SlurmError, SlurmParseError
from torchpass_slurm.slurm import hostlist
from torchpass_slurm.slurm.models import NODE_BASE_STATES, Job, Node, SlurmVersion

logger = logging.getLogger(__name__)

__all__ = [
    "parse_sinfo_json",
    "parse_squeue_json",
    "parse_version",
    "parse_job_id",
    "split_state",
]


def load_json(text: str, what: str) -> dict[str, Any]:
    """Decode Slurm's JSON document; check its ``errors`` list is empty."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        raise SlurmParseError(what, f"not JSON ({err.msg} at line {err.lineno})", excerpt=text) from None
    if not isinstance(doc, dict):
        raise SlurmParseError(what, f"expected a JSON object, got {type(doc).__name__}", excerpt=text)
    errors = doc.get("errors") or []
    if errors:
        said = "; ".join(_error_text(e) for e in errors) if isinstance(errors, list) else str(errors)
        raise SlurmError(f"{what} reported errors: {said}", hint="the message above is Slurm's own.")
    for warning in doc.get("warnings") or []:
        logger.warning("%s: %s", what, _error_text(warning))
    return doc


def _error_text(entry: object) -> str:
    if isinstance(entry, Mapping):
        return str(entry.get("description") or entry.get("error") or entry)
    return str(entry)


def number(value: object, what: str = "number") -> int | None:
    """An integer from Slurm JSON: plain, or wrapped as ``{"set", "infinite", "number"}``.

    Unset and infinite values are ``None``.
    """
    if value is None:
        return None
    if isinstance(value, Mapping):
        if not value.get("set", True) or value.get("infinite", False):
            return None
        value = value.get("number")
    if isinstance(value, bool) or not isinstance(value, int):
        raise SlurmParseError(what, f"expected an integer, got {value!r}", excerpt=json.dumps(value))
    return value


def split_state(value: object, what: str = "state") -> tuple[str, frozenset[str]]:
    """``"MIXED+DRAIN"``, ``["MIXED", "DRAIN"]`` or ``"idle"`` -> ``("MIXED", {"DRAIN"})``.

    The base state is the first word that is a base node state (or simply the
    first word); every other word is a flag.
    """
    if isinstance(value, str):
        words = [w for w in value.split("+") if w]
    elif isinstance(value, list) and all(isinstance(w, str) for w in value):
        words = list(value)
    else:
        raise SlurmParseError(what, f"expected a string or a list of strings, got {value!r}")
    words = [w.strip().upper() for w in words if w.strip()]
    if not words:
        raise SlurmParseError(what, "the state is empty")
    base = next((w for w in words if w in NODE_BASE_STATES), words[0])
    return base, frozenset(w for w in words if w != base)


def _field(record: Mapping[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    """``record[key]``, checked to be of ``kind``; SlurmParseError with an excerpt otherwise."""
    if not isinstance(record, Mapping):
        raise SlurmParseError(what, f"expected an object, got {record!r}"[:120])
    if key not in record:
        raise SlurmParseError(what, f"missing key {key!r}", excerpt=json.dumps(record))
    value = record[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise SlurmParseError(
            what, f"{key!r} should be {names}, got {type(value).__name__}", excerpt=json.dumps(record)
        )
    return value


def _list(doc: Mapping[str, Any], key: str, what: str) -> list[Any]:
    return list(_field(doc, key, list, what))


# --- nodes -----------------------------------------------------------------


def parse_sinfo_json(text: str) -> tuple[Node, ...]:
    """Nodes from ``sinfo --json`` (22.05 or 24.11 shape) or ``scontrol show nodes --json``.

    One :class:`Node` per node name, in Slurm's order; a node listed under
    several partitions gets all of them.
    """
    what = "sinfo --json output"
    doc = load_json(text, what)
    if "sinfo" in doc:
        nodes = [n for rec in _list(doc, "sinfo", what) for n in _nodes_of_group(rec, what)]
    elif "nodes" in doc:
        nodes = [_node_of_record(rec, what) for rec in _list(doc, "nodes", what)]
    else:
        raise SlurmParseError(what, "neither 'sinfo' nor 'nodes' is a key", excerpt=text)
    return _merge_partitions(nodes)


def _node_of_record(rec: Mapping[str, Any], what: str) -> Node:
    """One entry of ``nodes[]`` (22.05 sinfo, scontrol --json)."""
    name = _field(rec, "name", str, what)
    state, flags = split_state(_field(rec, "state", (str, list), what), f"{what}: state of {name}")
    extra = rec.get("state_flags") or []
    if not isinstance(extra, list):
        raise SlurmParseError(what, f"state_flags of {name} should be a list", excerpt=json.dumps(rec))
    flags |= {str(f).upper() for f in extra}
    reason = rec.get("reason")
    if isinstance(reason, Mapping):
        reason = reason.get("description")
    partitions = rec.get("partitions") or []
    return Node(
        name=name,
        state=state,
        flags=frozenset(flags),
        reason=str(reason) if reason else None,
        partitions=tuple(str(p) for p in partitions),
        cpus=number(rec.get("cpus"), f"{what}: cpus of {name}"),
    )


def _nodes_of_group(rec: Mapping[str, Any], what: str) -> list[Node]:
    """One entry of ``sinfo[]`` (23.11+): several nodes sharing a state and a partition."""
    state_value = _field(_field(rec, "node", Mapping, what), "state", (str, list), what)
    state, flags = split_state(state_value, f"{what}: node.state")
    names = _field(_field(rec, "nodes", Mapping, what), "nodes", list, what)
    reason = rec.get("reason")
    if isinstance(reason, Mapping):
        reason = reason.get("description")
    partition = (rec.get("partition") or {}).get("name")
    cpus = rec.get("cpus") or {}
    low, high = number(cpus.get("minimum"), what), number(cpus.get("maximum"), what)
    return [
        Node(
            name=str(name),
            state=state,
            flags=flags,
            reason=str(reason) if reason else None,
            partitions=(str(partition),) if partition else (),
            cpus=low if low == high else None,
        )
        for name in names
    ]


def _merge_partitions(nodes: list[Node]) -> tuple[Node, ...]:
    merged: dict[str, Node] = {}
    for node in nodes:
        seen = merged.get(node.name)
        if seen is None:
            merged[node.name] = node
            continue
        parts = seen.partitions + tuple(p for p in node.partitions if p not in seen.partitions)
        merged[node.name] = Node(seen.name, seen.state, seen.flags, seen.reason, parts, seen.cpus)
    return tuple(merged.values())


# --- jobs ------------------------------------------------------------------


def parse_squeue_json(text: str) -> tuple[Job, ...]:
    """Jobs from ``squeue --json`` (22.05 or 24.11 shape), in Slurm's order."""
    what = "squeue --json output"
    doc = load_json(text, what)
    return tuple(_job_of_record(rec, what) for rec in _list(doc, "jobs", what))


def _job_of_record(rec: Mapping[str, Any], what: str) -> Job:
    job_id = number(_field(rec, "job_id", (int, Mapping), what), f"{what}: job_id")
    if job_id is None:
        raise SlurmParseError(what, "a job has no job_id", excerpt=json.dumps(rec))
    state, flags = split_state(_field(rec, "job_state", (str, list), what), f"{what}: job_state")
    nodelist = _field(rec, "nodes", str, what)
    return Job(
        job_id=job_id,
        name=str(rec.get("name") or ""),
        state=state,
        flags=flags,
        nodes=expand_nodelist(nodelist, what),
        batch_host=rec.get("batch_host") or None,
        partition=rec.get("partition") or None,
        reason=reason_text(rec.get("state_reason")),
        num_nodes=number(rec.get("node_count"), f"{what}: node_count"),
        comment=rec.get("comment") or None,
        std_out=rec.get("standard_output") or None,
        work_dir=rec.get("current_working_directory") or None,
    )


def reason_text(value: object) -> str | None:
    """A job's reason, or None when Slurm says there is none (``""``, ``"None"``)."""
    if not value or value == "None":
        return None
    return str(value)


def expand_nodelist(value: str, what: str) -> tuple[str, ...]:
    """A node list Slurm printed, expanded; ``(null)``/``None`` means none."""
    if value.strip() in {"", "(null)", "None"}:
        return ()
    try:
        return hostlist.expand(value)
    except HostlistError as err:
        raise SlurmParseError(what, f"bad node list: {err.message}", excerpt=value) from None


# --- small text outputs ----------------------------------------------------

_VERSION = re.compile(r"^slurm(?:-wlm)?\s+(\d+)\.(\d+)(?:\.(\d+))?(\S*)\s*$")


def parse_version(text: str) -> SlurmVersion:
    """``slurm 22.05.8`` or Debian's ``slurm-wlm 24.11.5`` (``sinfo --version``)."""
    match = _VERSION.match(text.strip())
    if match is None:
        raise SlurmParseError("sinfo --version output", "expected 'slurm X.Y.Z'", excerpt=text)
    major, minor, micro, extra = match.groups()
    return SlurmVersion(int(major), int(minor), int(micro or 0), extra)


def parse_job_id(text: str) -> int:
    """The job id printed by ``sbatch --parsable``: ``42`` or ``42;cluster``."""
    first = text.strip().split(";", 1)[0]
    if not first.isdigit():
        raise SlurmParseError("sbatch --parsable output", "expected a job id", excerpt=text)
    return int(first)
