"""State that belongs to one rank (its data loader position): copies to the supervisor, restore by step.

What is identical on every replica (model, optimizer) travels from a replica in a live
migration (:mod:`.handover`). What belongs to one rank does not exist anywhere else: a data
loader's position over its shard, a small Stateful whose ``state_dict`` is JSON. So every
rank sends the supervisor a copy of it, and the spare that takes its logical rank gets the
lost rank's copies with its promotion (``promote.rank_state``)::

    step k:  batch drawn ── forward pre-hook: capture, tag k+1 ──► rank_state to the supervisor
             all-reduce ── commit (step = k+1)                         (outbox; no ack, no fsync)
    a rank dies; the others agree on S
    every rank: restore(S)   its live state is tagged S: nothing to do
                             else its own copy tagged S (a step discarded after its capture)
                             else (a promoted spare) the promote's copy tagged S
                             else: rank_state_missing, and RankStateError: never a wrong one

The copy is taken when the step's collectives start, so the copy of step k+1 is on its way
before step k can commit anywhere; the supervisor keeps two copies per rank because the
last may be of a step that never committed. Copies are strict JSON, at most
:data:`~torchpass_slurm.control.rankstate.MAX_RANK_STATE_BYTES`; nothing is unpickled.
In a checkpoint the state is saved beside the training state (:meth:`RankState.checkpoint_entry`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from torchpass_slurm.control.kinds import Kind, ReportKind
from torchpass_slurm.control.rank_bodies import RankStateCopy
from torchpass_slurm.control.rankstate import (
    MAX_RANK_STATE_BYTES,
    MAX_RANK_STATE_COPIES,
    canonical,
    check_copy,
)
from torchpass_slurm.control.schema import JSONObject
from torchpass_slurm.errors import ControlPlaneError, TorchpassError
from torchpass_slurm.rank.rankinfo import Role
from torchpass_slurm.rank.runtime import Runtime

__all__ = ["RankState", "RankStateError", "RANK_STATE_KEY"]

#: The key of the rank state beside the training state in a checkpoint.
RANK_STATE_KEY = "torchpass_rank_state"


class RankStateError(TorchpassError):
    """A rank's own state cannot be sent (not bounded JSON) or restored (no copy of the agreed step)."""

    exit_code = 6


class RankState:
    """The ``rank_state`` of one rank (name -> Stateful with a JSON ``state_dict``); see the module doc."""

    def __init__(self, rt: Runtime, objects: Mapping[str, Any]) -> None:
        self.rt = rt
        self.objects = dict(objects)
        #: the tag of the state the objects hold now (None: never captured)
        self.tag: int | None = None
        self._copies: list[tuple[int, JSONObject]] = []  # this rank's own last copies

    def capture(self, tag: int) -> None:
        """Copy the objects' state as the one valid once step ``tag`` commits; send it to the supervisor."""
        state = {name: obj.state_dict() for name, obj in self.objects.items()}
        try:
            check_copy(tag, state, f"rank_state of rank {self.rt.rank}")
        except ControlPlaneError as exc:
            raise RankStateError(
                exc.message,
                hint="rank_state holds small per-rank positions as JSON (str, int, float, bool, None, "
                f"lists, str-keyed dicts; at most {MAX_RANK_STATE_BYTES} bytes); tensors go in state",
            ) from None
        copy = json.loads(canonical(state))  # detached from the live objects
        self._copies = [*(c for c in self._copies if c[0] < tag), (tag, copy)][-MAX_RANK_STATE_COPIES:]
        self.tag = tag
        if self.rt.role is not Role.PLAIN:
            self.rt.outbox.put((Kind.RANK_STATE, RankStateCopy(self.rt.rank, tag, copy).to_body()))

    def forget_held(self) -> None:
        """The objects may hold a state no copy has (a step failed after its batch was drawn and
        before the capture: in FSDP2's own pre-forward all-gather, say): the next
        :meth:`restore` loads a copy even of the step they were tagged with."""
        self.tag = None

    def restore(self, step: int, offered: Sequence[tuple[int, Mapping[str, Any]]] = ()) -> None:
        """Make the objects hold the state of committed step ``step``: from this rank's own copies, else
        from ``offered`` (a promotion's). Raise RankStateError (after telling the supervisor) if none is."""
        if self.tag == step:
            return
        found = next((s for t, s in [*self._copies, *offered] if t == step), None)
        if found is None:
            tags = sorted({t for t, _ in [*self._copies, *offered]})
            self.rt.report(ReportKind.RANK_STATE_MISSING, step=step, tags=tags, epoch=self.rt.epoch)
            raise RankStateError(
                f"rank {self.rt.rank} has no copy of its rank state of step {step} (only of steps {tags})",
                hint="its previous holder died before its copy reached the supervisor; the job must "
                "restart from a checkpoint",
            )
        for name, obj in self.objects.items():
            if name not in found:
                raise RankStateError(
                    f"the rank state of step {step} has no {name!r} (it has {sorted(found)})"
                )
            obj.load_state_dict(found[name])
        self.rt.log.info("rank state restored to step %d", step)
        self.capture(step)

    def checkpoint_entry(self) -> _CheckpointEntry:
        """A Stateful to save beside the training state (under :data:`RANK_STATE_KEY`)."""
        return _CheckpointEntry(self)


class _CheckpointEntry:
    """This rank's state as a fixed-size byte tensor under ``rank<R>`` (DCP keeps one copy of equal
    keys, and loads into tensors of the saved shape): canonical JSON, zero-padded. No pickle."""

    def __init__(self, owner: RankState) -> None:
        self.owner = owner

    def state_dict(self) -> dict[str, Any]:
        import torch

        state = {name: obj.state_dict() for name, obj in self.owner.objects.items()}
        data = canonical(state).encode("ascii")
        if len(data) > MAX_RANK_STATE_BYTES:
            raise RankStateError(f"rank state is {len(data)} bytes; the limit is {MAX_RANK_STATE_BYTES}")
        buf = torch.zeros(MAX_RANK_STATE_BYTES, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return {f"rank{self.owner.rt.rank}": buf}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        from torchpass_slurm import jsonsafe

        key = f"rank{self.owner.rt.rank}"
        if key not in state_dict:
            raise RankStateError(f"the checkpoint has no rank state for {key} (it has {sorted(state_dict)})")
        text = bytes(state_dict[key].tolist()).rstrip(b"\0").decode("ascii")
        state = jsonsafe.loads(text, max_depth=32)
        for name, obj in self.owner.objects.items():
            obj.load_state_dict(state[name])
        self.owner.tag = None  # the trainer captures it again at the checkpoint's step
