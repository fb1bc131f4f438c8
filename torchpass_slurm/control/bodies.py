"""Typed bodies of the control messages the supervisor sends, and of the reports ranks send.

The wire stays a JSON object checked against
:data:`~torchpass_slurm.control.messages.BODY_SCHEMAS`; these dataclasses are
the one place each body's fields are named, built (``to_body``) and read back
(``from_body``), by the supervisor, the rank side and the test fakes alike.
``from_body`` raises :class:`~torchpass_slurm.errors.ControlPlaneError` for a
body that does not fit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torchpass_slurm.control.messages import ReportKind
from torchpass_slurm.control.rankstate import check_copies
from torchpass_slurm.errors import ControlPlaneError
from torchpass_slurm.mesh import MeshLayout
from torchpass_slurm.strenum import StrEnum

__all__ = ["PromoteMode", "Promote", "Reconfigure", "Stop", "Report"]


class PromoteMode(StrEnum):
    """How a promoted spare joins: live (it receives the state from a replica) or restart."""

    LIVE = "live"
    RESTART = "restart"


def _field(body: Mapping[str, Any], name: str, kind: type, what: str) -> Any:
    value = body.get(name)
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        raise ControlPlaneError(f"{what} body field {name!r} is {value!r}; expected {kind.__name__}")
    return value


@dataclass(frozen=True)
class Promote:
    """Supervisor -> a spare's task: take global rank ``rank`` in ``epoch``.

    ``rank_state``: a live promotion's last copies of the rank's own state (its data
    loader position), as ``(step tag, state)``, oldest first (``control/rankstate.py``).
    """

    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    epoch: int
    mode: PromoteMode
    store_addr: str = ""
    store_port: int = 0
    rank_state: tuple[tuple[int, Mapping[str, Any]], ...] = ()

    def to_body(self) -> dict[str, Any]:
        copies = (
            {"rank_state": [[tag, dict(state)] for tag, state in self.rank_state]} if self.rank_state else {}
        )
        return {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "epoch": self.epoch,
            "mode": self.mode.value,
            "store_addr": self.store_addr,
            "store_port": self.store_port,
            **copies,
        }

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Promote:
        try:
            mode = PromoteMode(body.get("mode", PromoteMode.RESTART.value))
        except ValueError:
            raise ControlPlaneError(
                f"promote body field 'mode' is {body.get('mode')!r}; "
                f"expected one of {', '.join(m.value for m in PromoteMode)}"
            ) from None
        ints = {
            n: _field(body, n, int, "promote")
            for n in ("rank", "local_rank", "world_size", "master_port", "epoch")
        }
        return cls(
            master_addr=_field(body, "master_addr", str, "promote"),
            mode=mode,
            store_addr=str(body.get("store_addr") or ""),
            store_port=int(body.get("store_port") or 0),
            rank_state=tuple(check_copies(body["rank_state"])) if "rank_state" in body else (),
            **ints,
        )


@dataclass(frozen=True)
class Reconfigure:
    """Supervisor -> the ranks that stay: rebuild the process group for ``epoch``.

    ``planned``: a drain. Every rank switches after committing step
    ``switch_after`` (announced far enough ahead that all hear of it first),
    and the ranks in ``leave`` hand over and leave instead.
    """

    epoch: int
    world_size: int
    store_addr: str
    store_port: int
    planned: bool = False
    leave: tuple[int, ...] = ()
    switch_after: int | None = None

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "epoch": self.epoch,
            "world_size": self.world_size,
            "store_addr": self.store_addr,
            "store_port": self.store_port,
        }
        if self.planned:
            body.update(planned=True, leave=list(self.leave))
            if self.switch_after is not None:
                body["switch_after"] = self.switch_after
        return body

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Reconfigure:
        leave = body.get("leave", [])
        if not isinstance(leave, list) or any(isinstance(r, bool) or not isinstance(r, int) for r in leave):
            raise ControlPlaneError(f"reconfigure body field 'leave' is {leave!r}; expected a list of ranks")
        return cls(
            epoch=_field(body, "epoch", int, "reconfigure"),
            world_size=_field(body, "world_size", int, "reconfigure"),
            store_addr=_field(body, "store_addr", str, "reconfigure"),
            store_port=_field(body, "store_port", int, "reconfigure"),
            planned=body.get("planned") is True,
            leave=tuple(leave),
            switch_after=None
            if body.get("switch_after") is None
            else _field(body, "switch_after", int, "reconfigure"),
        )


@dataclass(frozen=True)
class Stop:
    """Supervisor -> a task: leave now (exit 0)."""

    reason: str

    def to_body(self) -> dict[str, Any]:
        return {"reason": self.reason}


#: Fields every report of a kind must carry, with their JSON types (others may come too).
REPORT_FIELDS: Mapping[ReportKind, Mapping[str, type]] = {
    ReportKind.AGREEMENT: {"committed_step": int, "epoch": int},
    ReportKind.FIRST_STEP: {"step": int, "epoch": int},
    ReportKind.RESUMED: {"step": int, "epoch": int},
    ReportKind.COLLECTIVE_FAILED: {"epoch": int},
    ReportKind.GROUP_REBUILT: {"epoch": int},
    ReportKind.TRANSFER_DONE: {"epoch": int},
    ReportKind.RELEASED: {"epoch": int},
    ReportKind.HEALTH_WARNING: {"status": str, "summary": str},
    ReportKind.RANK_STATE_MISSING: {"step": int, "epoch": int},
}
#: Fields any report may carry, with their types when present. Every field of a report
#: may end up in the event log, and the log's readers rely on these types.
OPTIONAL_REPORT_FIELDS: Mapping[str, tuple[type, ...]] = {
    "rank": (int, type(None)),
    "epoch": (int,),
    "step": (int,),
    "committed_step": (int,),
    "seconds": (int, float),
    "bytes": (int,),
    "retries": (int,),
    "error": (str,),
    #: a sharded rank's device mesh (``MeshLayout.to_json``), in its ``live_ready``
    "mesh": (dict,),
}
#: Names a report's fields may not use: the event log's own keys, and ``node``, which the
#: supervisor sets from the sender (only the health agent's report names its node itself).
RESERVED_REPORT_FIELDS = frozenset({"ts", "kind", "job", "node"})


@dataclass(frozen=True)
class Report:
    """Rank -> supervisor: a fact (``kind``) with its fields (``rank`` among them)."""

    kind: ReportKind
    fields: Mapping[str, Any]

    @property
    def epoch(self) -> int | None:
        epoch = self.fields.get("epoch")
        return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None

    @property
    def mesh(self) -> MeshLayout | None:
        """The device mesh the rank reported (checked by :meth:`from_body`), if any."""
        value = self.fields.get("mesh")
        return None if value is None else MeshLayout.from_json(value)

    def to_body(self) -> dict[str, Any]:
        return {"event": self.kind.value, "fields": dict(self.fields)}

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
        for name, type_ in REPORT_FIELDS.get(kind, {}).items():
            _field(fields, name, type_, what)
        for name, types in OPTIONAL_REPORT_FIELDS.items():
            value = fields.get(name)
            if name in fields and (isinstance(value, bool) or not isinstance(value, types)):
                wanted = " or ".join("null" if t is type(None) else t.__name__ for t in types)
                raise ControlPlaneError(f"{what} field {name!r} is {value!r}; expected {wanted}")
        reserved = RESERVED_REPORT_FIELDS - ({"node"} if kind == ReportKind.HEALTH_WARNING else set())
        clash = sorted(reserved & set(fields))
        if clash:
            raise ControlPlaneError(f"{what} has fields named {', '.join(clash)}; those names are reserved")
        if "mesh" in fields:
            try:  # a layout the planner cannot trust is no layout: the whole report is refused
                MeshLayout.from_json(fields["mesh"])
            except (ValueError, TypeError) as exc:  # TypeError: an unhashable dimension name
                raise ControlPlaneError(f"{what} field 'mesh' is not a mesh layout: {exc}") from None
        return cls(kind, dict(fields))
