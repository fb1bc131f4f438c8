"""Typed bodies of the control messages the supervisor sends: promote, reconfigure, stop, ack.

These dataclasses are the one place each body's fields are named, built
(``to_body``) and read back (``from_body``), by the supervisor, the rank side
and the test fakes alike; :func:`~torchpass_slurm.control.messages.decode`
checks a received body with the same ``from_body``, which raises
:class:`~torchpass_slurm.errors.ControlPlaneError` for a body that does not
fit. The bodies a rank sends are in :mod:`.rank_bodies`, its reports in
:mod:`.reports` (:class:`Report` is re-exported here).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torchpass_slurm.control.rankstate import check_copies
from torchpass_slurm.control.reports import Report
from torchpass_slurm.control.schema import JSONObject
from torchpass_slurm.errors import ControlPlaneError
from torchpass_slurm.strenum import StrEnum

__all__ = ["PromoteMode", "Promote", "Reconfigure", "Stop", "Ack", "Report"]


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
    mode: PromoteMode = PromoteMode.RESTART
    store_addr: str = ""
    store_port: int = 0
    rank_state: tuple[tuple[int, Mapping[str, Any]], ...] = ()

    def to_body(self) -> JSONObject:
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

    def to_body(self) -> JSONObject:
        body: JSONObject = {
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

    def to_body(self) -> JSONObject:
        return {"reason": self.reason}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Stop:
        return cls(reason=_field(body, "reason", str, "stop"))


@dataclass(frozen=True)
class Ack:
    """Both ways: the message with sequence number ``seq`` arrived."""

    seq: int

    def to_body(self) -> JSONObject:
        return {"seq": self.seq}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Ack:
        return cls(seq=_field(body, "seq", int, "ack"))
