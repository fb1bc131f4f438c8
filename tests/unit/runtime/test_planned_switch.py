"""The planned switch without a per-step collective, and a fenced rank leaving: the trainer's
reactions to what the supervisor says, without a process group."""

from __future__ import annotations

import datetime
import logging
import queue
import threading
from typing import Any

import pytest
import torch

from torchpass_slurm.control.bodies import Reconfigure
from torchpass_slurm.rank.elastic import ElasticTrainer


class StubRuntime:
    """What _planned_switch_due reads of a Runtime: its epoch and its reconfigure queue."""

    def __init__(self) -> None:
        self.epoch = 0
        self.reconfigures: queue.Queue[Reconfigure] = queue.Queue()

    def wait_reconfigure(self, timeout: datetime.timedelta) -> Reconfigure | None:
        try:
            return self.reconfigures.get(timeout=timeout.total_seconds())
        except queue.Empty:
            return None


def trainer(rt: Any) -> ElasticTrainer:
    model = torch.nn.Linear(2, 2)
    return ElasticTrainer(rt, model, torch.optim.SGD(model.parameters(), lr=0.1), state={})


def planned(epoch: int, switch_after: int | None) -> Reconfigure:
    return Reconfigure(
        epoch=epoch,
        world_size=3,
        store_addr="c1",
        store_port=1,
        planned=True,
        leave=(2,),
        switch_after=switch_after,
    )


def test_the_switch_comes_after_the_announced_step_and_not_before() -> None:
    rt = StubRuntime()
    t = trainer(rt)
    rt.reconfigures.put(planned(1, switch_after=5))
    t.step = 4
    assert t._planned_switch_due() is None  # kept for later
    t.step = 5
    assert t._planned_switch_due() == planned(1, 5)
    assert t._planned_switch_due() is None  # taken once


def test_a_rank_that_heard_late_switches_at_once() -> None:
    rt = StubRuntime()
    t = trainer(rt)
    t.step = 9
    rt.reconfigures.put(planned(1, switch_after=5))
    assert t._planned_switch_due() == planned(1, 5)


def test_a_switch_announced_past_the_last_step_happens_at_the_end(monkeypatch: pytest.MonkeyPatch) -> None:
    rt = StubRuntime()
    rt.log = logging.getLogger("test")  # type: ignore[attr-defined]
    t = trainer(rt)
    t._started = True
    t.step = 16
    rt.reconfigures.put(planned(1, switch_after=17))
    switched: list[Reconfigure] = []
    monkeypatch.setattr(t, "_reconfigure", switched.append)
    rt.state = None  # type: ignore[attr-defined]
    t.fit(lambda step, model: torch.zeros(()), steps=16)
    assert switched == [planned(1, 17)]


def test_an_unplanned_or_old_reconfigure_is_not_a_planned_switch() -> None:
    rt = StubRuntime()
    rt.epoch = 2
    t = trainer(rt)
    t.step = 10
    rt.reconfigures.put(Reconfigure(epoch=3, world_size=3, store_addr="c1", store_port=1))
    rt.reconfigures.put(planned(2, switch_after=1))  # the epoch this rank is already in
    assert t._planned_switch_due() is None
    assert [b.epoch for b in t._pending] == [3, 2]  # the unplanned one waits for the recovery path


def test_the_reconfigure_body_carries_the_switch_step() -> None:
    body = planned(1, switch_after=7).to_body()
    assert body["switch_after"] == 7 and Reconfigure.from_body(body).switch_after == 7
    assert "switch_after" not in Reconfigure(epoch=1, world_size=3, store_addr="c1", store_port=1).to_body()


class FencedRuntime(StubRuntime):
    """A runtime the supervisor told to stop (what Runtime._on_message does on ``stop``)."""

    def __init__(self) -> None:
        super().__init__()
        self.stop_requested = threading.Event()
        self.stop_requested.set()
        self.log = logging.LoggerAdapter(logging.getLogger("test"), {})


def test_a_fenced_rank_trains_no_further_step() -> None:
    t = trainer(FencedRuntime())
    t._started = True
    steps: list[int] = []
    with pytest.raises(SystemExit, match="fenced by the supervisor at step 0"):
        t.fit(lambda step, model: steps.append(step), steps=5)  # type: ignore[func-returns-value]
    assert steps == []


def test_a_fenced_rank_does_not_wait_for_a_new_epoch() -> None:
    t = trainer(FencedRuntime())
    with pytest.raises(SystemExit):
        t._next_reconfigure(datetime.timedelta(seconds=60))
