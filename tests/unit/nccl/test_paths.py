"""Issue 26, step 6: every NCCL control path of the seam (``rank/backends.py``) runs here, under
torch's ``fake`` backend: the real torch world state (the default group, a mesh's groups, torch's
group abort) and the real orchestration (``rank/group.py``'s record, the supervisor's word from
the heartbeat thread, the teardown, ``Runtime.rejoin`` through the epoch store). What the fake
cannot show: NCCL itself (a non-blocking communicator's abort, ncclCommShrink); see
docs/design/nccl.md."""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchpass_slurm.control.bodies import Reconfigure
from torchpass_slurm.rank import backends, group
from torchpass_slurm.rank.backends import NcclBackend, NcclCapabilities, Rebuild, RebuildRequest
from torchpass_slurm.rank.runtime import Role, Runtime

from ..gloo_ranks import FakeClient, info, loopback_store

LOG = logging.LoggerAdapter(logging.getLogger(__name__), {})
TIMEOUT = datetime.timedelta(seconds=60)
SHRINKS = NcclCapabilities(nccl_version=(2, 28, 9), group_abort=True, shrink=True)
#: An abort must be over within this (the collective timeout is TIMEOUT).
AT_ONCE_S = 2.0


class Spy:
    """Counts the calls of the seam's group abort and the groups each got, and passes them on."""

    def __init__(self, then: Callable[[], None] = lambda: None) -> None:
        self.then = then
        self.calls = 0
        self.groups: list[int] = []

    def __call__(self, groups: list[Any]) -> None:
        self.calls += 1
        self.groups.append(len(groups))
        backends._group_abort(groups)
        self.then()


def fake_nccl(abort_every: Callable[[list[Any]], None] | None = None, **kwargs: Any) -> NcclBackend:
    """The NCCL backend's own code on torch's fake backend: no pg_options, no device to bind."""
    return NcclBackend("fake", options=None, device=lambda info: None, abort_every=abort_every, **kwargs)


@pytest.fixture(autouse=True)
def no_group_left() -> Iterator[None]:
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    group.destroy_group(LOG)


def build(seam: NcclBackend, epoch: int = 1, rank: int = 1, world: int = 4, subgroups: int = 2) -> int:
    """This rank's groups as a sharded job has them: the default group and a mesh's ``subgroups``."""
    seam.create(info(rank, world, 0, epoch=epoch), TIMEOUT, LOG, store=FakeStore())
    for _ in range(subgroups):
        dist.new_group(list(range(world)))
    return len(distributed_c10d._world.pg_map)


# --- create ------------------------------------------------------------------------------------


def test_create_asks_for_a_non_blocking_eagerly_connected_communicator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: seen.update(kwargs))
    monkeypatch.setattr(group, "adopt_group", lambda *a, **k: None)
    seam = NcclBackend(options=lambda: "non-blocking options", device=lambda info: f"cuda:{info.local_rank}")

    assert seam.create(info(2, 4, 0, epoch=3), TIMEOUT, LOG, store="the epoch's store") == 0
    assert seen == {
        "backend": "nccl",
        "rank": 2,
        "world_size": 4,
        "timeout": TIMEOUT,
        "store": "the epoch's store",
        "pg_options": "non-blocking options",
        "device_id": "cuda:0",
    }


def test_create_warns_of_a_setting_that_lets_the_watchdog_end_a_survivor(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    with caplog.at_level(logging.WARNING):
        fake_nccl().create(info(0, 2, 0, epoch=1), TIMEOUT, LOG, store=FakeStore())
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=3 (want 2)" in caplog.text
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    caplog.clear()
    group.destroy_group(LOG)
    with caplog.at_level(logging.WARNING):
        fake_nccl().create(info(0, 2, 0, epoch=2), TIMEOUT, LOG, store=FakeStore())
    assert "defeat" not in caplog.text


def test_create_records_the_group_with_the_backends_abort_and_no_socket() -> None:
    seam = fake_nccl()
    build(seam, epoch=5)
    assert group.live_group() == (5, False)
    assert group._live is not None and group._live.sockets == () and group._live.abort_all is not None


# --- abort: the supervisor's word ---------------------------------------------------------------


def test_the_supervisors_word_aborts_every_group_of_the_rank_in_one_group_abort() -> None:
    spy = Spy()
    seam = fake_nccl(spy)
    assert build(seam, epoch=1, subgroups=2) == 3

    body = group.superseding(Reconfigure(epoch=2, world_size=4, store_addr="h", store_port=1), LOG)

    assert body.epoch == 2
    assert (spy.calls, spy.groups) == (1, [3])  # one call for the three groups
    # torch still lists them: the training thread's next collective fails as a comm error, it
    # does not find the default group gone (a ValueError that would end the rank)
    assert dist.is_initialized() and len(distributed_c10d._world.pg_map) == 3
    assert dist.get_world_size() == 4
    assert group.live_group() == (1, True)
    assert not seam.abort_all(LOG)  # never twice
    assert spy.calls == 1


def test_a_planned_reconfigure_leaves_the_groups_alone() -> None:
    spy = Spy()
    build(fake_nccl(spy))
    group.superseding(Reconfigure(epoch=2, world_size=4, store_addr="h", store_port=1, planned=True), LOG)
    assert spy.calls == 0 and dist.is_initialized()


def test_the_abort_from_the_heartbeat_thread_does_not_wait_for_the_stuck_collective() -> None:
    """The training thread sits in a collective that only an abort ends (a frozen peer): the
    heartbeat thread's abort returns at once, and the collective ends with it, not at its timeout."""
    aborted = threading.Event()
    seam = fake_nccl(Spy(aborted.set))
    build(seam)
    left: list[float] = []

    def training() -> None:  # a collective that the communicator's abort ends
        aborted.wait(TIMEOUT.total_seconds())
        left.append(time.monotonic())

    thread = threading.Thread(target=training)
    thread.start()
    time.sleep(0.1)
    started = time.monotonic()
    assert seam.abort_all(LOG)
    returned = time.monotonic() - started
    thread.join(AT_ONCE_S)
    assert returned < AT_ONCE_S
    assert left and left[0] - started < AT_ONCE_S


def test_the_abort_never_waits_for_a_training_thread_that_is_destroying_the_group() -> None:
    spy = Spy()
    seam = fake_nccl(spy)
    build(seam)
    with group._lock:  # the training thread is in destroy_group: it has left its collective
        started = time.monotonic()
        assert not seam.abort_all(LOG)
        assert time.monotonic() - started < AT_ONCE_S
    assert spy.calls == 0


def broken(groups: list[Any]) -> None:
    raise RuntimeError("NCCL error: unhandled system error")


def test_a_failing_group_abort_falls_back_to_each_groups_own_abort(caplog: pytest.LogCaptureFixture) -> None:
    seam = fake_nccl(broken)
    groups = build(seam)
    with caplog.at_level(logging.INFO):
        assert seam.abort_all(LOG)
    assert "group abort of 3 process groups failed" in caplog.text
    assert f"{groups} of {groups} process groups aborted" in caplog.text


class Group:
    def __init__(self, fails: bool) -> None:
        self.fails = fails
        self.aborted = False

    def abort(self) -> None:
        if self.fails:
            raise RuntimeError("abort hangs up")
        self.aborted = True


def test_a_group_whose_own_abort_fails_does_not_keep_the_others_alive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    listed = [Group(fails=False), Group(fails=True), Group(fails=False)]
    monkeypatch.setattr(backends, "_torch_groups", lambda: listed)

    assert fake_nccl(broken).abort_groups(LOG) == 2
    assert [g.aborted for g in listed] == [True, False, True]


# --- teardown after an observed error ------------------------------------------------------------


def no_destroy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records each destroy_process_group: none may meet an aborted (broken) communicator."""
    destroyed: list[str] = []
    monkeypatch.setattr(dist, "destroy_process_group", lambda group=None: destroyed.append("destroyed"))
    return destroyed


def test_an_observed_error_aborts_every_group_before_the_references_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spy = Spy()
    seam = fake_nccl(spy)
    build(seam)
    destroyed = no_destroy(monkeypatch)
    order: list[str] = []
    try:
        raise RuntimeError("NCCL communicator was aborted on rank 1")
    except RuntimeError as exc:
        with seam.tear_down(exc, LOG, keep_for=30.0):
            order.append(f"body after {spy.calls} abort")
    assert order == ["body after 1 abort"]
    assert group.live_group() is None and not dist.is_initialized()
    assert group._kept == []  # torch forgot the aborted groups: nothing is kept to destroy later
    assert destroyed == []


def test_a_teardown_whose_forgetting_fails_still_ends_with_no_group(caplog: pytest.LogCaptureFixture) -> None:
    def refuses() -> None:
        raise RuntimeError("Invalid process group specified or has been destroyed.")

    spy = Spy()
    seam = fake_nccl(spy, forget_every=refuses)
    build(seam)
    with caplog.at_level(logging.WARNING), seam.tear_down(RuntimeError("NCCL error"), LOG):
        pass
    assert "abort of every process group failed" in caplog.text
    assert spy.calls == 1 and not dist.is_initialized()  # destroy_group destroyed them


def test_a_teardown_after_the_supervisors_abort_aborts_nothing_twice() -> None:
    spy = Spy()
    seam = fake_nccl(spy)
    build(seam)
    assert group.abort_group_before(2, LOG)
    with seam.tear_down(RuntimeError("NCCL error"), LOG):
        pass
    assert spy.calls == 1 and group.live_group() is None and not dist.is_initialized()


# --- rebuild: shrink or fresh --------------------------------------------------------------------


class Fresh:
    def __init__(self, seam: NcclBackend, epoch: int, world: int) -> None:
        self.seam, self.epoch, self.world, self.calls = seam, epoch, world, 0

    def __call__(self) -> None:
        self.calls += 1
        self.seam.create(info(0, self.world, 0, epoch=self.epoch), TIMEOUT, LOG, store=FakeStore())


def shrink_like_torch(excluded: list[int]) -> None:
    """What torch's shrink_group leaves: a new, smaller default group, the others gone."""
    world = dist.get_world_size()
    distributed_c10d._abort_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world - len(excluded))


def test_a_live_group_that_loses_named_ranks_is_shrunk_not_rebuilt() -> None:
    shrunk: list[list[int]] = []
    seam = fake_nccl(
        capabilities=lambda: SHRINKS, shrink=lambda ex: (shrunk.append(ex), shrink_like_torch(ex))
    )
    build(seam, epoch=1, world=4)
    fresh = Fresh(seam, 2, 3)

    assert seam.rebuild(RebuildRequest(2, 4, 3, excluded=(3,)), fresh, LOG) is Rebuild.SHRINK
    assert shrunk == [[3]] and fresh.calls == 0
    assert dist.get_world_size() == 3 and group.live_group() == (2, False)
    assert seam.abort_all(LOG)  # the shrunk group is aborted like any other


def test_a_shrink_the_backend_does_not_support_aborts_and_builds_fresh(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """torch's own shrink_group, on a backend without ncclCommShrink: it raises TypeError."""
    spy = Spy()
    seam = fake_nccl(spy, capabilities=lambda: SHRINKS)
    build(seam, epoch=1, world=4)
    fresh = Fresh(seam, 2, 3)
    with caplog.at_level(logging.WARNING):
        assert seam.rebuild(RebuildRequest(2, 4, 3, excluded=(3,)), fresh, LOG) is Rebuild.FRESH
    assert "does not support shrinking" in caplog.text
    assert spy.calls == 1 and fresh.calls == 1
    assert dist.get_world_size() == 3 and group.live_group() == (2, False)


def test_a_group_the_supervisor_aborted_is_never_shrunk() -> None:
    shrunk: list[list[int]] = []
    seam = fake_nccl(capabilities=lambda: SHRINKS, shrink=lambda ex: shrunk.append(ex))
    build(seam, epoch=1, world=4)
    assert group.abort_group_before(2, LOG)
    fresh = Fresh(seam, 2, 3)
    assert seam.rebuild(RebuildRequest(2, 4, 3, excluded=(3,)), fresh, LOG) is Rebuild.FRESH
    assert shrunk == [] and fresh.calls == 1


def test_a_spare_that_joins_gets_a_fresh_communicator_even_where_shrink_is_offered() -> None:
    shrunk: list[list[int]] = []
    seam = fake_nccl(capabilities=lambda: SHRINKS, shrink=lambda ex: shrunk.append(ex))
    build(seam, epoch=1, world=4)
    fresh = Fresh(seam, 2, 4)
    assert seam.rebuild(RebuildRequest(2, 4, 4, excluded=(3,)), fresh, LOG) is Rebuild.FRESH
    assert shrunk == [] and fresh.calls == 1 and group.live_group() == (2, False)


# --- the runtime's rejoin, through the epoch store -----------------------------------------------


@pytest.fixture
def store() -> Iterator[int]:
    with loopback_store() as port:
        yield port


def reconfigure(epoch: int, port: int) -> Reconfigure:
    return Reconfigure(epoch=epoch, world_size=1, store_addr="127.0.0.1", store_port=port)


def test_rejoin_aborts_and_builds_each_epochs_group_in_the_epoch_store_and_survives_a_second_fault(
    store: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = Spy()
    seam = fake_nccl(spy)
    rt = Runtime(Role.ACTIVE, info(0, 1, store), environ={}, client=FakeClient())
    rt.init_process_group(seam, TIMEOUT, TIMEOUT)
    assert group.live_group() == (0, False)

    assert group.abort_group_before(1, LOG)  # the supervisor's word: epoch 1
    destroyed = no_destroy(monkeypatch)
    real_create = seam.create
    faults = iter([RuntimeError("NCCL error: remote process exited")])

    def create_once_failing(*args: Any, **kwargs: Any) -> int:
        fault = next(faults, None)
        if fault is not None:  # a second fault while epoch 1's group is built
            raise fault
        return real_create(*args, **kwargs)

    monkeypatch.setattr(seam, "create", create_once_failing)
    with pytest.raises(RuntimeError, match="remote process exited"):
        rt.rejoin(reconfigure(1, store), seam, TIMEOUT, TIMEOUT)
    assert group.live_group() is None and not dist.is_initialized()  # epoch 0's forgotten, not destroyed
    assert destroyed == []
    monkeypatch.undo()

    rt.rejoin(reconfigure(2, store), seam, TIMEOUT, TIMEOUT)  # the next epoch builds
    assert rt.epoch == 2 and group.live_group() == (2, False)
    assert dist.get_backend() == "fake" and spy.calls == 1


def test_the_gloo_path_keeps_its_socket_record_and_no_backend_abort(store: int) -> None:
    rt = Runtime(Role.ACTIVE, info(0, 1, store), environ={}, client=FakeClient())
    rt.init_process_group("gloo", TIMEOUT, TIMEOUT)
    assert group._live is not None and group._live.abort_all is None
    assert dist.get_backend() == "gloo"
