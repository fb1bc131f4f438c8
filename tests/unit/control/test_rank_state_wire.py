"""The ``rank_state`` message and a promote's ``rank_state``, signed but hostile: refused by ``decode``.

The frames are signed as the protocol says (docs/protocol.md, "The MAC"), so every refusal
here is the body check's, not the MAC's.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from torchpass_slurm.control import messages as m
from torchpass_slurm.control.bodies import Promote, PromoteMode, Report
from torchpass_slurm.control.rankstate import (
    MAX_RANK_STATE_BYTES,
    MAX_RANK_STATE_NESTING,
    canonical,
    check_copies,
)
from torchpass_slurm.errors import ControlPlaneError

from .test_hostile import NOW, SECRET, frames


def payload(kind: str, body: Any, sender: str = "n1/0") -> bytes:
    obj = {"body": body, "kind": kind, "sender": sender, "seq": 1, "to": "supervisor", "ts": NOW}
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def decoded(kind: str, body: Any) -> m.Message:
    return m.decode(frames(payload(kind, body)), SECRET, allowed=m.ALL_KINDS, now=NOW)


def nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth - 1):
        value = {"x": value}
    return value


GOOD = {"rank": 3, "step": 12, "state": {"data": {"position": 120, "epoch": 1, "order": [3, 1, 2]}}}


def test_a_rank_state_message_round_trips() -> None:
    assert decoded(m.RANK_STATE, GOOD).body == GOOD
    assert decoded(m.RANK_STATE, {**GOOD, "state": nested(MAX_RANK_STATE_NESTING)}).body["state"]


HOSTILE: list[tuple[str, dict[str, Any], str]] = [
    ("oversize", {**GOOD, "state": {"blob": "x" * (MAX_RANK_STATE_BYTES + 1)}}, "the limit is"),
    ("a list, not an object", {**GOOD, "state": [1, 2]}, "is list; expected dict"),
    ("a string state", {**GOOD, "state": "{}"}, "is str; expected dict"),
    ("deep nesting", {**GOOD, "state": nested(MAX_RANK_STATE_NESTING + 1)}, "nested deeper"),
    ("a negative tag", {**GOOD, "step": -1}, "step tag is -1"),
    ("a boolean tag", {**GOOD, "step": True}, "expected int"),
    ("a string tag", {**GOOD, "step": "12"}, "expected int"),
    ("a float tag", {**GOOD, "step": 12.0}, "expected int"),
    ("no rank", {"step": 1, "state": {}}, "lacks the field 'rank'"),
    ("a null rank", {**GOOD, "rank": None}, "expected int"),
]


@pytest.mark.parametrize(("why", "body", "said"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_rank_state_messages_are_refused(why: str, body: dict[str, Any], said: str) -> None:
    with pytest.raises(ControlPlaneError, match=said):
        decoded(m.RANK_STATE, body)


def test_an_oversize_copy_within_the_frame_is_still_refused() -> None:
    """The frame limit alone (64 KiB) would let one copy through that two could not carry."""
    state = {"blob": "x" * (MAX_RANK_STATE_BYTES - 10)}
    assert len(canonical(state)) == MAX_RANK_STATE_BYTES + 1
    with pytest.raises(ControlPlaneError, match="the limit is"):
        decoded(m.RANK_STATE, {**GOOD, "state": state})


PROMOTE = Promote(
    rank=1, local_rank=0, world_size=4, master_addr="n1", master_port=29500, epoch=1, mode=PromoteMode.LIVE
).to_body()


def test_two_copies_of_the_largest_state_fit_in_one_promote() -> None:
    big = {"blob": "x" * (MAX_RANK_STATE_BYTES - 20)}
    body = Promote.from_body({**PROMOTE, "rank_state": [[1, big], [2, big]]}).to_body()
    message = m.Message(m.PROMOTE, m.SUPERVISOR, 1, NOW, body, to="n2/0")
    frames_ = m.encode(message, SECRET)
    assert len(frames_[1]) <= m.MAX_FRAME_BYTES
    assert Promote.from_body(m.decode(frames_, SECRET, now=NOW).body).rank_state == ((1, big), (2, big))


BAD_COPIES: list[tuple[str, Any, str]] = [
    ("three copies", [[1, {}], [2, {}], [3, {}]], "at most 2"),
    ("not a list", {"1": {}}, "expected a list"),
    ("a bare state", [{"position": 3}], r"expected \[step, state\]"),
    ("a forged tag", [[-5, {}]], "step tag is -5"),
    ("a tag that is not a step", [["7", {}]], "step tag is '7'"),
    ("tags out of order", [[4, {}], [3, {}]], "not increasing"),
    ("a duplicated tag", [[4, {}], [4, {}]], "not increasing"),
    ("a state that is not an object", [[4, [1]]], "expected a JSON object"),
    ("deep nesting", [[4, nested(MAX_RANK_STATE_NESTING + 1)]], "nested deeper"),
]


@pytest.mark.parametrize(("why", "copies", "said"), BAD_COPIES, ids=[b[0] for b in BAD_COPIES])
def test_a_promote_with_hostile_copies_is_refused_on_both_ends(why: str, copies: Any, said: str) -> None:
    with pytest.raises(ControlPlaneError, match=said):
        check_copies(copies)
    with pytest.raises(ControlPlaneError, match=said):
        Promote.from_body({**PROMOTE, "rank_state": copies})
    body = {**PROMOTE, "rank_state": copies}
    with pytest.raises(ControlPlaneError):
        m.decode(
            frames(
                payload(m.PROMOTE, body, sender="supervisor").replace(b'"to":"supervisor"', b'"to":"n2/0"')
            ),
            SECRET,
            now=NOW,
        )


@pytest.mark.parametrize(
    "mesh",
    [
        {"dims": ["shard"], "shape": [4], "replicate": "nope"},
        {"dims": [["a"]], "shape": [4]},
        {"dims": ["shard"], "shape": [0]},
        {"dims": ["x"] * 9, "shape": [1] * 9},
        {"dims": ["shard"], "shape": [4], "more": True},
        ["shard"],
    ],
)
def test_a_live_ready_with_a_malformed_mesh_is_refused(mesh: Any) -> None:
    with pytest.raises(ControlPlaneError, match="mesh"):
        Report.from_body({"event": "live_ready", "fields": {"rank": 0, "step": 0, "epoch": 0, "mesh": mesh}})
