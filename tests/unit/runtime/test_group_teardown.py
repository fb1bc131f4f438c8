"""Issue 12, item 4: no survivor waits in a dead collective.

A rank whose collective failed tears its group down at once (the DDP
wrapper and the failed call's frames first, then the group), so a peer that
waits on it leaves within milliseconds, not at its collective timeout; an
unplanned reconfigure aborts the old group where the torch in use can.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import itertools
import logging
import multiprocessing
import os
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from torchpass_slurm.control.bodies import Reconfigure
from torchpass_slurm.rank import elastic, group
from torchpass_slurm.rank.elastic import ElasticTrainer
from torchpass_slurm.rank.runtime import Role, Runtime

from ..gloo_ranks import FakeClient, info, loopback_store

GLOO_RESET = RuntimeError(
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:41234"
)
LOG = logging.LoggerAdapter(logging.getLogger(__name__), {})
#: The peer's collective timeout: far longer than the test may wait for it to leave.
PEER_TIMEOUT_S = 60
#: How long the failed rank waits for a reconfigure that never comes (the old code's only exit).
NO_RECONFIGURE_S = 6
#: A peer must leave its collective within this of the other rank's failure.
LEAVE_WITHIN_S = 2.5
JOIN_TIMEOUT_S = 60


@pytest.fixture
def store() -> Iterator[int]:
    with loopback_store() as port:
        yield port


# --- the teardown, in one process --------------------------------------------------------------


def test_a_failed_collective_drops_the_ddp_wrapper_and_destroys_the_group_before_waiting(
    store: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt = Runtime(Role.ACTIVE, info(0, 1, store), environ={}, client=FakeClient())
    model = nn.Linear(4, 1)
    trainer = ElasticTrainer(rt, model, torch.optim.SGD(model.parameters(), lr=0.1), state={})
    trainer.start()
    trainer.ddp_model = nn.parallel.DistributedDataParallel(model)  # one rank: start() does not wrap
    wrapper = weakref.ref(trainer.ddp_model)
    seen: list[tuple[bool, bool, bool]] = []
    real_wait = rt.wait_reconfigure

    def wait_reconfigure(timeout: datetime.timedelta) -> Reconfigure | None:
        if failed:  # what holds the old group while the trainer waits for the supervisor
            seen.append((dist.is_initialized(), trainer.ddp_model is model, wrapper() is None))
            rt.reconfigures.put(Reconfigure(epoch=1, world_size=1, store_addr="127.0.0.1", store_port=store))
            failed.clear()
        return real_wait(timeout)

    monkeypatch.setattr(rt, "wait_reconfigure", wait_reconfigure)
    failed: list[bool] = []

    def train_step(step: int, m: nn.Module) -> torch.Tensor:
        loss = m(torch.ones(2, 4)).pow(2).mean()
        loss.backward()
        if step == 1 and not trainer.migrations:
            failed.append(True)
            raise GLOO_RESET  # its frame holds the DDP wrapper ``m``
        return loss

    trainer.fit(train_step, steps=3)

    assert seen and seen[0] == (False, True, True)
    assert (trainer.migrations, rt.epoch, trainer.step) == (1, 1, 3)  # rejoin found no group: fine


class GilWatch(threading.Thread):
    """A thread that ticks every few milliseconds, as the heartbeat thread beats: the longest
    gap between two ticks is how long another thread held the GIL (issue 21)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.longest, self._last, self._done = 0.0, time.monotonic(), threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.002):
            now = time.monotonic()
            self.longest, self._last = max(self.longest, now - self._last), now

    def __enter__(self) -> GilWatch:
        self.start()
        time.sleep(0.05)
        self.longest = 0.0
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()
        self.join()


def test_tearing_down_never_holds_the_gil_for_as_long_as_a_full_collection(store: int) -> None:
    """A training process holds millions of Python objects (a data index, a tokenizer's tables):
    a full ``gc.collect()`` walks them all with the GIL held. On the dev cluster the teardown's
    collection silenced a rank's heartbeat thread until its node was declared hung."""
    heap = [[None] for _ in range(3_000_000)]
    began = time.monotonic()
    gc.collect()
    full_collection = time.monotonic() - began
    assert full_collection > 0.1, "the heap is too small for a collection to show"
    dist.init_process_group(
        "gloo", store=dist.TCPStore("127.0.0.1", store, is_master=False), rank=0, world_size=1
    )
    group.adopt_group(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))

    with GilWatch() as watch, group.tearing_down(GLOO_RESET, LOG):
        del model

    assert not dist.is_initialized()
    assert watch.longest < full_collection / 2, (watch.longest, full_collection)
    assert len(heap) == 3_000_000


def test_a_broken_group_is_kept_past_its_teardown_until_its_collectives_must_have_ended(
    store: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Debian's torch 2.6 runs a gloo group's destructor with the GIL held, waiting for the work
    in flight (up to the collective timeout): torch forgets the broken group at once, but its
    object is let go only at a step boundary after ``keep_for``."""
    monkeypatch.setattr(group, "_kept", [])
    dist.init_process_group(
        "gloo", store=dist.TCPStore("127.0.0.1", store, is_master=False), rank=0, world_size=1
    )
    group.adopt_group(0)
    world = dist.group.WORLD

    with group.tearing_down(GLOO_RESET, LOG, keep_for=30.0):
        pass

    assert not dist.is_initialized()
    assert [groups for _, groups in group._kept] == [(world,)]
    assert group.release_kept() == 0  # not yet: its work may still wait out the timeout
    assert group.release_kept(now=time.monotonic() + 31.0) == 1
    assert group._kept == []


def test_destroying_a_group_that_is_already_gone_is_a_no_op() -> None:
    assert not dist.is_initialized()
    group.destroy_group(LOG)
    group.destroy_group(LOG)


# --- the teardown between real gloo processes ----------------------------------------------------


def _failing_rank(port: int, out: str) -> None:
    """Rank 0: its first step fails (a dead peer, as it saw it); no reconfigure ever comes."""
    os.environ["TORCHPASS_COLLECTIVE_TIMEOUT"] = str(PEER_TIMEOUT_S)
    os.environ["TORCHPASS_SPARE_WAIT"] = "0"  # the wait is RECONFIGURE_TIMEOUT alone
    elastic.RECONFIGURE_TIMEOUT = datetime.timedelta(seconds=NO_RECONFIGURE_S)
    rt = Runtime(Role.ACTIVE, info(0, 2, port), environ={}, client=FakeClient())
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    trainer = ElasticTrainer(rt, model, torch.optim.SGD(model.parameters(), lr=0.1), state={})

    def train_step(step: int, m: nn.Module) -> torch.Tensor:
        Path(out, "failed").write_text(repr(time.monotonic()))
        raise GLOO_RESET

    with contextlib.suppress(RuntimeError):
        trainer.fit(train_step, steps=1)
    os._exit(0)


def _waiting_rank(port: int, out: str) -> None:
    """Rank 1: a survivor in an all-reduce that rank 0 never joins; when did it leave?"""
    rt = Runtime(Role.ACTIVE, info(1, 2, port), environ={}, client=FakeClient())
    rt.init_process_group("gloo", datetime.timedelta(seconds=PEER_TIMEOUT_S))
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))  # matches rank 0's wrap
    try:
        dist.all_reduce(torch.ones(4))
    except RuntimeError as exc:
        Path(out, "left").write_text(repr(time.monotonic()))
        Path(out, "error").write_text(str(exc))
    del ddp
    os._exit(0)


def test_a_survivor_leaves_its_collective_once_its_failed_peer_tears_down(store: int, tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=f, args=(store, str(tmp_path))) for f in (_failing_rank, _waiting_rank)]
    for p in procs:
        p.start()
    procs[1].join(JOIN_TIMEOUT_S)  # the waiting rank exits once it left; the failed one may wait on
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()

    failed = float((tmp_path / "failed").read_text())
    left = float((tmp_path / "left").read_text())
    assert left - failed < LEAVE_WITHIN_S, (left - failed, (tmp_path / "error").read_text())


# --- the abort -----------------------------------------------------------------------------------


class FakeGroup:
    def __init__(self) -> None:
        self.aborts = 0

    def abort(self) -> None:
        self.aborts += 1


class OldGroup:
    """A torch 2.6 group: no abort."""


def test_a_newer_epoch_aborts_the_old_group_once(monkeypatch: pytest.MonkeyPatch) -> None:
    old = FakeGroup()
    monkeypatch.setattr(group, "_live", group._Live(old, epoch=0))

    assert group.abort_group_before(1, LOG)
    assert not group.abort_group_before(2, LOG)  # aborted already
    assert old.aborts == 1


def test_a_group_of_the_reconfigured_epoch_is_never_aborted(monkeypatch: pytest.MonkeyPatch) -> None:
    new = FakeGroup()  # the training thread has already rejoined epoch 2
    monkeypatch.setattr(group, "_live", group._Live(new, epoch=2))

    assert not group.abort_group_before(2, LOG)
    assert not group.abort_group_before(1, LOG)  # a late reconfigure of an older epoch
    assert new.aborts == 0


def test_no_abort_while_the_training_thread_destroys_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    old = FakeGroup()
    monkeypatch.setattr(group, "_live", group._Live(old, epoch=0))
    with group._lock:  # the training thread is in destroy_group: it has left its collective
        began = time.monotonic()
        assert not group.abort_group_before(1, LOG)
        assert time.monotonic() - began < 0.5  # the heartbeat thread did not wait
    assert old.aborts == 0


def test_the_abort_is_a_no_op_when_torch_cannot_abort(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(group, "_live", group._Live(OldGroup(), epoch=0))
    assert not group.can_abort(OldGroup())
    assert not group.abort_group_before(1, LOG)
    monkeypatch.setattr(group, "_live", None)  # no group at all (a spare, or torn down)
    assert not group.abort_group_before(1, LOG)


class Msg:
    def __init__(self, kind: str, body: dict[str, Any]) -> None:
        self.kind, self.body = kind, body


@pytest.mark.parametrize("planned", [False, True], ids=["unplanned", "planned"])
def test_only_an_unplanned_reconfigure_aborts_the_old_group(
    planned: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = FakeGroup()
    monkeypatch.setattr(group, "_live", group._Live(old, epoch=0))
    rt = Runtime(Role.ACTIVE, info(0, 2, 1), environ={}, client=FakeClient())
    body = Reconfigure(epoch=1, world_size=2, store_addr="127.0.0.1", store_port=1, planned=planned)

    rt._on_message(Msg("reconfigure", body.to_body()))

    assert old.aborts == (0 if planned else 1)  # a planned switch votes on the old group first
    assert rt.reconfigures.get_nowait().epoch == 1


# --- the teardown never starves the heartbeat thread ----------------------------------------------

#: Longest the failed rank's other threads may go without the GIL during its teardown.
MAX_STARVED_S = 1.5


def _rank_with_queued_work(port: int, out: str) -> None:
    """Rank 0: an all-reduce is queued that its peer never joins (DDP's next bucket, while the peer
    sits elsewhere); then its step fails and it tears down, while a thread ticks as the heartbeat
    thread would. How long did that thread go without running?"""
    import threading

    rt = Runtime(Role.ACTIVE, info(0, 2, port), environ={}, client=FakeClient())
    rt.init_process_group("gloo", datetime.timedelta(seconds=PEER_TIMEOUT_S))
    model = nn.Linear(4, 1)
    trainer = ElasticTrainer(rt, model, torch.optim.SGD(model.parameters(), lr=0.1), state={})
    work = dist.all_reduce(torch.ones(1 << 16), async_op=True)
    time.sleep(0.5)  # the work is in gloo's worker, waiting on rank 1
    del work
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.02)

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    began = time.monotonic()
    trainer._tear_down(GLOO_RESET)
    took = time.monotonic() - began
    time.sleep(0.1)
    stop.set()
    ticker.join()
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    Path(out, "teardown").write_text(f"{took} {max(gaps)}")
    os._exit(0)


def _absent_peer(port: int, out: str) -> None:
    """Rank 1: in the group, but never in rank 0's all-reduce (until its timeout, long after)."""
    rt = Runtime(Role.ACTIVE, info(1, 2, port), environ={}, client=FakeClient())
    rt.init_process_group("gloo", datetime.timedelta(seconds=PEER_TIMEOUT_S))
    time.sleep(20)
    os._exit(0)


def test_a_rank_with_queued_work_tears_down_without_holding_the_gil(store: int, tmp_path: Path) -> None:
    """Seen on the dev cluster: a rank sat 5 s in ``destroy_process_group`` with the GIL held
    (gloo's destructor waits for queued work), and its node's heartbeats stopped. Measured in
    a cluster node with torch 2.6 (Debian's) and this scenario: the teardown had not ended after
    60 s without the sockets shut down first, 0.11 s with. torch 2.13's gloo does not wait."""
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=f, args=(store, str(tmp_path))) for f in (_rank_with_queued_work, _absent_peer)
    ]
    for p in procs:
        p.start()
    procs[0].join(JOIN_TIMEOUT_S)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    took, starved = map(float, (tmp_path / "teardown").read_text().split())
    assert took < MAX_STARVED_S and starved < MAX_STARVED_S, (took, starved)
