"""Typed reports: what a rank tells the supervisor (a ``report`` message), one class per kind.

A report travels as ``{"event": KIND, "fields": {...}}``. Its fields are the keys of one
dataclass per :class:`~torchpass_slurm.control.kinds.ReportKind` (:data:`REPORT_TYPES`),
declared with :mod:`.schema`: the rank builds and checks it in ``Runtime.report``, the
supervisor reads it back with :meth:`Report.from_body` (a malformed report is logged and
dropped there, never fatal), and the test fakes build theirs with :meth:`Report.of`. Keys a
kind does not declare are kept in ``extra`` (they reach the event log), but a key that any
kind declares has that kind's type in every report (:data:`FIELD_TYPES`): every field of a
report may end up in the event log, whose readers rely on them.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torchpass_slurm.control import schema
from torchpass_slurm.control.kinds import ReportKind
from torchpass_slurm.control.schema import JSONObject, wire
from torchpass_slurm.errors import ControlPlaneError
from torchpass_slurm.mesh import MeshLayout

__all__ = [
    "ReportFields",
    "LiveReady",
    "CollectiveFailed",
    "GroupRebuilt",
    "Agreement",
    "TransferDone",
    "FirstStep",
    "Released",
    "Resumed",
    "HealthWarning",
    "RankStateMissing",
    "REPORT_TYPES",
    "RESERVED_REPORT_FIELDS",
    "ReportEnvelope",
    "Report",
    "field_types",
]

#: Names a report's fields may not use unless its kind declares them: the event log's own
#: keys, and ``node``, which the supervisor sets from the sender (only the health agent's
#: report names its node itself).
RESERVED_REPORT_FIELDS = frozenset({"ts", "kind", "job", "node"})


def _mesh(value: Any, what: str) -> MeshLayout:
    try:  # a layout the planner cannot trust is no layout: the whole report is refused
        return MeshLayout.from_json(value)
    except (ValueError, TypeError) as exc:  # TypeError: an unhashable dimension name
        raise ControlPlaneError(f"{what} is not a mesh layout: {exc}") from None


_RANKS = wire(items=int)


@dataclass(frozen=True, kw_only=True)
class ReportFields:
    """What every report may carry: the sending ``rank`` and its ``epoch``; ``extra``: the keys
    its kind does not declare."""

    rank: int | None = field(default=None, metadata=wire(null=True))
    epoch: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict, metadata=wire(extra=True))


@dataclass(frozen=True, kw_only=True)
class LiveReady(ReportFields):
    """Its training runs the elastic loop; a sharded rank says its device ``mesh``."""

    step: int | None = None
    mesh: MeshLayout | None = field(
        default=None, metadata=wire(json=(dict,), decode=_mesh, encode=MeshLayout.to_json)
    )


@dataclass(frozen=True, kw_only=True)
class CollectiveFailed(ReportFields):
    """A collective failed in ``epoch`` at ``step``; it waits for a reconfigure."""

    epoch: int
    step: int | None = None
    error: str | None = None


@dataclass(frozen=True, kw_only=True)
class GroupRebuilt(ReportFields):
    """The new epoch's process group is up after ``seconds``."""

    epoch: int
    seconds: float | None = None


@dataclass(frozen=True, kw_only=True)
class Agreement(ReportFields):
    """Rank 0: the step every rank now holds, and who gives and takes the state."""

    committed_step: int
    epoch: int
    donors: tuple[int, ...] | None = field(default=None, metadata=_RANKS)
    receivers: tuple[int, ...] | None = field(default=None, metadata=_RANKS)
    leaving: tuple[int, ...] | None = field(default=None, metadata=_RANKS)


@dataclass(frozen=True, kw_only=True)
class TransferDone(ReportFields):
    """A receiver: the state of ``step`` arrived from ``donor`` (``sealed``: authenticated)."""

    epoch: int
    donor: int | None = None
    receiver: int | None = None
    step: int | None = None
    bytes: int | None = None
    seconds: float | None = None
    retries: int | None = None
    resumed_from: int | None = None
    sealed: bool | None = None
    #: how the state came: ``group`` (the new epoch's group), ``socket`` (a leaving rank's, or
    #: the socket route), ``mpi`` (TORCHPASS_TRANSPORT=mpi; ``rank/routes.py``)
    via: str | None = None


@dataclass(frozen=True, kw_only=True)
class FirstStep(ReportFields):
    """Rank 0: the first step of the new epoch committed."""

    step: int
    epoch: int


@dataclass(frozen=True, kw_only=True)
class Released(ReportFields):
    """A rank of a drained node handed over (at ``step``) and left the job."""

    epoch: int
    step: int | None = None


@dataclass(frozen=True, kw_only=True)
class Resumed(ReportFields):
    """Rank 0 resumed from the checkpoint of ``step`` after a restart."""

    step: int
    epoch: int


@dataclass(frozen=True, kw_only=True)
class HealthWarning(ReportFields):
    """The node's in-job health agent saw ``status`` (WARNING or CRITICAL); ``move_now``: a GPU
    signal that takes the node now (``health/gpu_signals.py``), an unplanned move rather than
    a drain at a step boundary."""

    status: str
    summary: str
    node: str | None = None
    move_now: bool | None = None


@dataclass(frozen=True, kw_only=True)
class RankStateMissing(ReportFields):
    """A rank that took over has no copy of its rank state of ``step`` (only of ``tags``)."""

    step: int
    epoch: int
    tags: tuple[int, ...] | None = field(default=None, metadata=_RANKS)


#: The fields of each report kind.
REPORT_TYPES: Mapping[ReportKind, type[ReportFields]] = {
    ReportKind.LIVE_READY: LiveReady,
    ReportKind.COLLECTIVE_FAILED: CollectiveFailed,
    ReportKind.GROUP_REBUILT: GroupRebuilt,
    ReportKind.AGREEMENT: Agreement,
    ReportKind.TRANSFER_DONE: TransferDone,
    ReportKind.FIRST_STEP: FirstStep,
    ReportKind.RELEASED: Released,
    ReportKind.RESUMED: Resumed,
    ReportKind.HEALTH_WARNING: HealthWarning,
    ReportKind.RANK_STATE_MISSING: RankStateMissing,
}


@functools.cache
def field_types() -> Mapping[str, schema.Spec]:
    """Every key some report kind declares, with its wire rule (the first kind's that declares it)."""
    found: dict[str, schema.Spec] = {}
    for cls in REPORT_TYPES.values():
        for spec in schema.specs(cls):
            found.setdefault(spec.name, spec)
    return found


@dataclass(frozen=True)
class ReportEnvelope:
    """A report's body as :func:`~torchpass_slurm.control.messages.decode` checks it: the kind
    and an object of fields (their own check is :meth:`Report.from_body`'s)."""

    event: str
    fields: Mapping[str, Any]

    def to_body(self) -> JSONObject:
        return {"event": self.event, "fields": dict(self.fields)}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> ReportEnvelope:
        return schema.parse(cls, body, "'report' body")


@dataclass(frozen=True)
class Report:
    """Rank -> supervisor: a fact (``kind``) with its typed fields (``data``)."""

    kind: ReportKind
    data: ReportFields

    @property
    def rank(self) -> int | None:
        return self.data.rank

    @property
    def epoch(self) -> int | None:
        return self.data.epoch

    @property
    def mesh(self) -> MeshLayout | None:
        """The device mesh the rank reported (checked by :meth:`from_body`), if any."""
        return self.data.mesh if isinstance(self.data, LiveReady) else None

    @property
    def fields(self) -> JSONObject:
        """The fields as they travel (and as the event log records them)."""
        return schema.dump(self.data)

    def to_body(self) -> JSONObject:
        return {"event": self.kind.value, "fields": self.fields}

    @classmethod
    def of(cls, kind: ReportKind | str, **fields: Any) -> Report:
        """A report of ``kind`` with these wire fields, checked as the supervisor will."""
        return cls.from_body({"event": str(kind), "fields": fields})

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Report:
        try:
            kind = ReportKind(body.get("event"))
        except ValueError:
            raise ControlPlaneError(
                f"unknown report {body.get('event')!r}; expected one of "
                f"{', '.join(k.value for k in ReportKind)}"
            ) from None
        fields = body.get("fields")
        if not isinstance(fields, Mapping):
            raise ControlPlaneError(
                f"{kind.value!r} report fields are {type(fields).__name__}; expected an object"
            )
        what = f"{kind.value!r} report"
        data = schema.parse(REPORT_TYPES[kind], fields, what)
        known = field_types()
        for name, value in data.extra.items():
            if name in RESERVED_REPORT_FIELDS:
                raise ControlPlaneError(f"{what} has fields named {name}; those names are reserved")
            if name in known:
                schema.check_value(known[name], value, what)
        return cls(kind, data)
