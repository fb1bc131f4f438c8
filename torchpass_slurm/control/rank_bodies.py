"""Typed bodies of the messages a rank sends the supervisor: hello, heartbeat, standby, bye, rank_state.

Each is a dataclass whose fields are the keys of its JSON body (:mod:`.schema`): the rank
builds it and sends ``to_body()``; :func:`~torchpass_slurm.control.messages.decode` checks
a received body with ``from_body``, and the supervisor reads the same class. The per-node
heartbeat's ``tasks`` travel as arrays ``[local_rank, rank, step, state, age_ms, alive]``
(docs/protocol.md); :class:`TaskBeat` is one of them, typed. Reports are in :mod:`.reports`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from torchpass_slurm import jsonsafe
from torchpass_slurm.control import schema
from torchpass_slurm.control.rankstate import check_copy
from torchpass_slurm.control.schema import JSONObject, wire
from torchpass_slurm.errors import ControlPlaneError

__all__ = [
    "Hello",
    "Heartbeat",
    "TaskBeat",
    "Standby",
    "Bye",
    "RankStateCopy",
    "MAX_TASKS",
    "MAX_STATE_CHARS",
]

#: Most entries in a per-node heartbeat's ``tasks``, and the longest ``state`` one may carry.
MAX_TASKS = 1024
MAX_STATE_CHARS = 64


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class TaskBeat(NamedTuple):
    """One task of a per-node heartbeat: ``NODE/local_rank`` was last heard ``age_ms`` ago, at
    ``step`` in ``state``; ``alive``: its process lives (None: the relay did not say). A named
    tuple: its wire form is the array of its values, and a node's local rank 0 sends one per
    task every interval."""

    local_rank: int
    rank: int | None
    step: int | None
    state: str
    age_ms: int
    alive: bool | None = None

    def to_wire(self) -> list[Any]:
        return list(self) if self.alive is not None else list(self[:5])

    @classmethod
    def from_wire(cls, entry: object) -> TaskBeat:
        if not (
            isinstance(entry, list)
            and len(entry) in (5, 6)
            and (len(entry) == 5 or isinstance(entry[5], bool))
            and _is_int(entry[0])
            and 0 <= entry[0] <= jsonsafe.MAX_INT
            and (entry[1] is None or _is_int(entry[1]))
            and (entry[2] is None or _is_int(entry[2]))
            and isinstance(entry[3], str)
            and len(entry[3]) <= MAX_STATE_CHARS
            and _is_int(entry[4])
            and 0 <= entry[4] <= jsonsafe.MAX_INT
        ):
            raise ControlPlaneError(
                f"'heartbeat' body has the task entry {str(entry)[:80]}; expected [local_rank >= 0, "
                f"rank or null, step or null, state of at most {MAX_STATE_CHARS} characters, age_ms >= 0, "
                "alive (true or false, optional)]"
            )
        return cls(*entry)


def _tasks_from_wire(value: list[Any], what: str) -> tuple[TaskBeat, ...]:
    if len(value) > MAX_TASKS:
        raise ControlPlaneError(
            f"'heartbeat' body field 'tasks' is a list of {len(value)}; expected a list of at most "
            f"{MAX_TASKS} entries"
        )
    return tuple(TaskBeat.from_wire(entry) for entry in value)


def _tasks_to_wire(tasks: tuple[TaskBeat, ...]) -> list[list[Any]]:
    return [t.to_wire() for t in tasks[:MAX_TASKS]]


@dataclass(frozen=True)
class Hello(schema.Body):
    """An active task is up: ``node/local_rank`` holds global ``rank`` (None: not known yet)."""

    WIRE_NAME = "hello"

    node: str
    rank: int | None = field(metadata=wire(null=True))
    local_rank: int
    role: str
    pid: int
    world_size: int | None = None
    epoch: int | None = None
    #: the task is a spare that was promoted
    promoted: bool | None = None


@dataclass(frozen=True)
class Heartbeat(schema.Body):
    """A task is alive, at committed ``step`` (None: none yet) in phase ``state``
    (``torchpass_slurm.phase``). A node's local rank 0 adds the other tasks' beats
    (``tasks``); a rank's beat to its local rank 0 carries its ``pid``."""

    WIRE_NAME = "heartbeat"

    rank: int | None = field(metadata=wire(null=True))
    step: int | None = field(metadata=wire(null=True))
    state: str
    tasks: tuple[TaskBeat, ...] | None = field(
        default=None, metadata=wire(decode=_tasks_from_wire, encode=_tasks_to_wire)
    )
    pid: int | None = None


@dataclass(frozen=True)
class Bye(schema.Body):
    """A task leaves (its last heartbeat's fields, all optional)."""

    WIRE_NAME = "bye"

    rank: int | None = field(default=None, metadata=wire(null=True))
    step: int | None = field(default=None, metadata=wire(null=True))
    state: str | None = None


@dataclass(frozen=True)
class Standby(schema.Body):
    """A spare's task ``node/local_rank`` waits for promote or stop."""

    WIRE_NAME = "standby"

    node: str
    local_rank: int
    pid: int | None = None


@dataclass(frozen=True)
class RankStateCopy:
    """A copy of rank ``rank``'s own state, valid once step ``step`` commits (``control/rankstate.py``)."""

    rank: int
    step: int
    state: Mapping[str, Any]

    def to_body(self) -> JSONObject:
        return {"rank": self.rank, "step": self.step, "state": dict(self.state)}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> RankStateCopy:
        copy = schema.parse(cls, body, "'rank_state' body")
        check_copy(copy.step, copy.state, f"'rank_state' of rank {copy.rank}")
        return copy
