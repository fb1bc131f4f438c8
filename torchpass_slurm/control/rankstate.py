"""The wire rules of state that belongs to one rank (its data loader position): bounds, checks (no zmq).

A rank sends a copy of its rank state in a ``rank_state`` message each step (body
``{rank, step, state}``: ``step`` is the *tag*, the committed step the copy is valid at);
the supervisor keeps the last :data:`MAX_RANK_STATE_COPIES` per logical rank and hands
them to the spare that takes the rank, in the ``rank_state`` field of its ``promote``
(``[[tag, state], ...]``). Both ends check a copy here: a JSON object, at most
:data:`MAX_RANK_STATE_BYTES` in canonical form and :data:`MAX_RANK_STATE_NESTING` levels
deep, so that two copies always fit in one control frame
(:data:`~torchpass_slurm.control.messages.MAX_FRAME_BYTES`). Nothing is unpickled.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from torchpass_slurm import jsonsafe
from torchpass_slurm.control.schema import JSONObject
from torchpass_slurm.errors import ControlPlaneError

__all__ = [
    "MAX_RANK_STATE_BYTES",
    "MAX_RANK_STATE_NESTING",
    "MAX_RANK_STATE_COPIES",
    "canonical",
    "check_copy",
    "check_copies",
]

#: Largest copy of one rank's state, in canonical JSON (bytes). Two copies and a promote's
#: other fields fit in one 64 KiB control frame; a data loader's position is a few hundred bytes.
MAX_RANK_STATE_BYTES = 24 * 1024
#: Deepest nesting within a copy (the state object is level 1): in a promote the copy sits
#: four levels down the envelope (envelope, body, list, pair), whose limit is 16.
MAX_RANK_STATE_NESTING = 10
#: Copies the supervisor keeps per logical rank (and a promote carries): the one a rank sent
#: last may be of a step that never committed, so the one before it is kept too.
MAX_RANK_STATE_COPIES = 2


def canonical(state: object) -> str:
    """The canonical JSON text of a copy (the bytes counted against :data:`MAX_RANK_STATE_BYTES`)."""
    return json.dumps(state, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def check_copy(tag: object, state: object, where: str = "rank state") -> None:
    """Raise ControlPlaneError unless ``tag`` is a step (int >= 0) and ``state`` a bounded JSON object."""
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= jsonsafe.MAX_INT:
        raise ControlPlaneError(f"{where}: its step tag is {tag!r}; expected an integer >= 0")
    if not isinstance(state, dict):
        raise ControlPlaneError(f"{where} is a {type(state).__name__}; expected a JSON object")
    try:
        jsonsafe.check_value(state, max_depth=MAX_RANK_STATE_NESTING, where=where)
        size = len(canonical(state))
    except (jsonsafe.JSONRefused, TypeError, ValueError) as exc:
        raise ControlPlaneError(f"{where} is not bounded JSON: {exc}") from None
    if size > MAX_RANK_STATE_BYTES:
        raise ControlPlaneError(
            f"{where} is {size} bytes of JSON; the limit is {MAX_RANK_STATE_BYTES}",
            hint="rank_state is for small per-rank positions (a data loader's); "
            "put large state in the checkpoint",
        )


def check_copies(value: object, where: str = "rank_state") -> list[tuple[int, JSONObject]]:
    """A promote's ``rank_state``: at most :data:`MAX_RANK_STATE_COPIES` ``[tag, state]`` pairs,
    tags strictly increasing. The copies, as (tag, state); ControlPlaneError otherwise."""
    if not isinstance(value, list) or len(value) > MAX_RANK_STATE_COPIES:
        raise ControlPlaneError(
            f"{where} is {type(value).__name__} of {len(value) if isinstance(value, Sequence) else '-'} "
            f"items; expected a list of at most {MAX_RANK_STATE_COPIES} [step, state] pairs"
        )
    copies: list[tuple[int, JSONObject]] = []
    for pair in value:
        if not isinstance(pair, list) or len(pair) != 2:
            raise ControlPlaneError(f"{where} has the entry {str(pair)[:80]}; expected [step, state]")
        check_copy(pair[0], pair[1], f"{where} copy")
        if copies and pair[0] <= copies[-1][0]:
            raise ControlPlaneError(f"{where} steps are not increasing: {[c[0] for c in copies] + [pair[0]]}")
        copies.append((pair[0], pair[1]))
    return copies
