"""State that belongs to one rank: the supervisor keeps each rank's last two copies and hands them
to the spare that takes the rank (``promote.rank_state``); a copy from the wrong task is refused."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from torchpass_slurm.control import messages as msg
from torchpass_slurm.control.bodies import Promote
from torchpass_slurm.rundir import events as ev
from torchpass_slurm.supervisor.loop import RunState
from torchpass_slurm.supervisor.rankstates import RankStates

from .conftest import Harness, Live


def loader(position: int) -> dict[str, Any]:
    return {"data": {"position": position, "epoch": 0}}


def send_copy(h: Harness, sender: str, step: int, *, rank: int | None = None) -> None:
    """What ``RankState.publish`` sends from task ``sender`` (its own rank unless ``rank``)."""
    node, _local = sender.split("/")
    sim = h.world.current[node]
    own = h.world.rank_of(sim, sender)
    body = {"rank": own if rank is None else rank, "step": step, "state": loader(step * 10)}
    h.server.inject(sim.peers[sender], sender, msg.RANK_STATE, body)


def copies_at(h: Harness, sender: str, *steps: int, at: float) -> None:
    for i, step in enumerate(steps):
        h.world.at(at + 0.2 * i, lambda step=step: send_copy(h, sender, step))


def test_the_spare_that_takes_a_lost_rank_gets_its_last_two_copies(live: Live) -> None:
    h, ranks = live()
    copies_at(h, "c2/0", 1, 2, 3, at=1.0)
    copies_at(h, "c1/0", 1, 2, 3, at=1.0)
    h.world.go_silent("c2", at=3.0)
    ranks.fail_collective("c1", at=3.5)

    result = h.run()

    assert (result.state, result.restarts) == (RunState.SUCCEEDED, 0)
    (promote,) = h.promotes()
    assert (promote["to"], promote["mode"]) == ("c4/0", "live")
    assert promote["rank_state"] == [[2, loader(20)], [3, loader(30)]]
    assert Promote.from_body(promote).rank_state == ((2, loader(20)), (3, loader(30)))


def test_a_job_without_rank_state_promotes_as_before(live: Live) -> None:
    h, ranks = live()
    h.world.go_silent("c2", at=3.0)
    ranks.fail_collective("c1", at=3.5)

    h.run()

    (promote,) = h.promotes()
    assert "rank_state" not in promote


def test_a_restart_promotion_carries_no_copies_the_checkpoint_has_them(live: Live) -> None:
    h, ranks = live(recovery="restart")
    copies_at(h, "c2/0", 1, 2, at=1.0)
    h.world.go_silent("c2", at=3.0)
    ranks.fail_collective("c1", at=3.5)

    h.run()

    (promote,) = h.promotes()
    assert promote["mode"] == "restart" and "rank_state" not in promote


def test_a_copy_for_another_tasks_rank_is_refused(live: Live, caplog: pytest.LogCaptureFixture) -> None:
    h, ranks = live()
    copies_at(h, "c2/0", 1, 2, at=1.0)
    h.world.at(2.8, lambda: send_copy(h, "c3/0", 7, rank=1))  # c3 holds rank 2, not 1
    h.world.go_silent("c2", at=3.0)
    ranks.fail_collective("c1", at=3.5)

    with caplog.at_level(logging.WARNING, logger="torchpass_slurm.supervisor.rankstates"):
        h.run()

    (promote,) = h.promotes()
    assert promote["rank_state"] == [[1, loader(10)], [2, loader(20)]]
    assert any("refused the rank state of rank 1 from c3/0" in r.getMessage() for r in caplog.records)


def test_a_planned_move_promotes_once_the_leaving_rank_sent_its_last_copy(live: Live) -> None:
    h, _ = live()
    copies_at(h, "c2/0", 1, 2, at=1.0)

    def switch_copy(peer: bytes, message: msg.Message) -> None:  # the leaver trains on to the switch
        if message.kind == msg.RECONFIGURE and peer.startswith(b"c2/0"):
            h.world.at(h.clock.elapsed + 0.2, lambda: send_copy(h, "c2/0", 9))

    h.server.on_send.append(switch_copy)
    h.world.at(3.0, lambda: h.slurm.set_node("c2", "MIXED", "DRAIN", reason="maintenance"))

    result = h.run()

    assert (result.state, result.restarts) == (RunState.SUCCEEDED, 0)
    (promote,) = h.promotes()
    # copy 9 was sent after the plan: the promotion waited for it, not only for the copies at hand
    assert promote["rank_state"] == [[2, loader(20)], [9, loader(90)]]
    (done,) = h.of_kind(ev.MIGRATION_DONE)
    assert done.fields["planned"] is True


def test_rank_states_keep_the_last_two_copies_and_a_lower_tag_replaces_the_later_ones() -> None:
    states = RankStates()
    for tag in (1, 2, 3):
        states.offer(0, tag, {"p": tag})
    assert states.copies(0) == ((2, {"p": 2}), (3, {"p": 3}))
    states.offer(0, 3, {"p": "again"})  # step 3 recomputed after a discarded try
    assert states.copies(0) == ((2, {"p": 2}), (3, {"p": "again"}))
    states.offer(0, 1, {"p": "restart"})  # resumed from an older checkpoint
    assert states.copies(0) == ((1, {"p": "restart"}),)
    assert states.copies(5) == () and not states.holds(range(1, 4)) and states.holds([0])


def test_a_planned_move_promotes_on_the_leavers_copy_of_the_switch_step_before_it_released(
    live: Live,
) -> None:
    """A sharded leaving rank reports ``released`` only after it handed its shards to the spare,
    which needs the promotion: the promotion must not wait for ``released``, only for the copy."""
    h, ranks = live()
    copies_at(h, "c2/0", 1, 2, at=1.0)
    leave = ranks._leave
    waiting: list[tuple[Any, str, int]] = []
    ranks._leave = lambda sim, sender, epoch: waiting.append((sim, sender, epoch))  # type: ignore[method-assign]

    def on_send(peer: bytes, message: msg.Message) -> None:
        if message.kind == msg.RECONFIGURE and peer.startswith(b"c2/0"):
            switch = message.body["switch_after"]
            h.world.at(h.clock.elapsed + 0.2, lambda: send_copy(h, "c2/0", switch))
        elif message.kind == msg.PROMOTE:  # the spare is in: the leaver hands over, then leaves
            h.world.at(h.clock.elapsed + 0.3, lambda: [leave(*w) for w in waiting])

    h.server.on_send.append(on_send)
    h.world.at(3.0, lambda: h.slurm.set_node("c2", "MIXED", "DRAIN", reason="maintenance"))

    result = h.run()

    assert (result.state, result.restarts) == (RunState.SUCCEEDED, 0)
    (promote,) = h.promotes()
    assert promote["rank_state"][-1][0] >= 2
    sent = [s.message for s in h.server.sent if s.message.kind == msg.PROMOTE]
    (released,) = h.of_kind("released")
    assert sent[0].ts < released.ts  # promoted on the copy, before the leaver released
    (done,) = h.of_kind(ev.MIGRATION_DONE)
    assert done.fields["planned"] is True
