"""The supervisor without faults: launch, hello, standby, success, status.json, epoch fencing."""

from __future__ import annotations

from collections.abc import Callable

from torchpass_slurm.control import messages as msg
from torchpass_slurm.supervisor.loop import RunState
from torchpass_slurm.supervisor.workers import WorkerState

from .conftest import CONFIG, Harness


def test_happy_path_succeeds_and_stops_the_spare(make: Callable[..., Harness]) -> None:
    h = make(active=3, spares=1)

    result = h.run()

    assert (result.state, result.exit_code, result.epoch, result.restarts) == (RunState.SUCCEEDED, 0, 0, 0)
    assert result.message == "training completed"
    assert h.kinds() == ["started"] + ["worker_up"] * 4 + ["step_exited"] * 3 + ["finished"]
    started, *_ = h.events()
    assert started.fields == {
        "active": ["c1", "c2", "c3"],
        "spares": ["c4"],
        "world_size": 3,
        "ntasks_per_node": 1,
    }
    ups = {e.fields["node"]: e.fields for e in h.of_kind("worker_up")}
    assert ups["c2"] == {"node": "c2", "role": "active", "ranks": [1]}
    assert ups["c4"] == {"node": "c4", "role": "spare"}
    assert [e.fields["exit_code"] for e in h.of_kind("step_exited")] == [0, 0, 0]
    assert h.launches() == [("c1", "active", 0), ("c2", "active", 0), ("c3", "active", 0), ("c4", "spare", 0)]
    assert h.stopped_senders() == ["c4/0"]
    assert h.server.sent_of(msg.STOP)[0].message.body == {"reason": "training completed"}
    assert h.promotes() == []


def test_status_json_is_written_and_ends_succeeded(make: Callable[..., Harness]) -> None:
    h = make(active=2, spares=1, ntasks=2)
    seen: list[str] = []
    h.world.at(3.0, lambda: seen.append(h.status().state))

    h.run()

    assert seen == ["running"]
    status = h.status()
    assert (status.state, status.epoch, status.world_size, status.restarts) == ("succeeded", 0, 4, 0)
    assert status.job_id == "4242" and status.message == "training completed"
    nodes = {n.node: n for n in status.nodes}
    assert (nodes["c2"].role, nodes["c2"].ranks, nodes["c2"].exit_code) == ("active", (2, 3), 0)
    assert (nodes["c3"].role, nodes["c3"].ranks) == ("spare", ())
    assert nodes["c1"].last_step is not None and nodes["c1"].last_heartbeat is not None


def test_a_step_counts_as_up_only_when_every_task_said_hello(make: Callable[..., Harness]) -> None:
    h = make(active=1, spares=0, ntasks=2)
    h.world.hello_delay["c1"] = 3.0
    peer = b"c1/0#1"
    h.world.at(
        1.0,
        lambda: h.server.inject(
            peer,
            "c1/0",
            msg.HELLO,
            {"node": "c1", "rank": 0, "local_rank": 0, "role": "active", "pid": 1, "epoch": 0},
        ),
    )
    states: list[WorkerState] = []
    h.world.at(2.0, lambda: states.append(h.supervisor.steps["c1"].state))

    assert h.run().state == RunState.SUCCEEDED
    assert states == [WorkerState.STARTING]
    (up,) = h.of_kind("worker_up")
    assert up.ts - h.clock.WALL0 >= 3.0


def test_a_hello_of_another_epoch_is_ignored(make: Callable[..., Harness]) -> None:
    h = make(active=2, spares=0)
    h.world.hello_delay["c1"] = 3.0
    h.world.at(
        1.0,
        lambda: h.server.inject(
            b"c1/0#1",
            "c1/0",
            msg.HELLO,
            {"node": "c1", "rank": 0, "local_rank": 0, "role": "active", "pid": 1, "epoch": 5},
        ),
    )
    seen: list[tuple[WorkerState, RunState]] = []
    h.world.at(2.5, lambda: seen.append((h.supervisor.steps["c1"].state, h.supervisor.state)))

    assert h.run().state == RunState.SUCCEEDED
    assert seen == [(WorkerState.STARTING, RunState.LAUNCHING)]
    up = next(e for e in h.of_kind("worker_up") if e.fields["node"] == "c1")
    assert up.ts - h.clock.WALL0 >= 3.0


def test_messages_from_unknown_nodes_are_ignored(make: Callable[..., Harness]) -> None:
    h = make(active=1, spares=0)
    h.world.at(
        1.0,
        lambda: h.server.inject(
            b"x",
            "intruder/0",
            msg.HELLO,
            {"node": "intruder", "rank": 0, "local_rank": 0, "role": "active", "pid": 1, "epoch": 0},
        ),
    )

    assert h.run().state == RunState.SUCCEEDED
    assert [e.fields["node"] for e in h.of_kind("worker_up")] == ["c1"]


def test_a_straggler_hello_of_the_previous_epoch_is_ignored(make: Callable[..., Harness]) -> None:
    h = make(active=3, spares=1)
    h.world.crash("c2", 137, at=3.0)
    h.world.at(3.5, lambda: h.world.hello_delay.__setitem__("c1", 3.0))  # epoch 1's c1 is slow
    seen: list[WorkerState] = []

    def stale_hello_then_look() -> None:
        assert h.supervisor.membership.epoch == 1
        h.server.inject(
            b"c1/0#1",
            "c1/0",
            msg.HELLO,
            {"node": "c1", "rank": 0, "local_rank": 0, "role": "active", "pid": 1, "epoch": 0},
        )
        h.world.at(h.clock.elapsed + 1.0, lambda: seen.append(h.supervisor.steps["c1"].state))

    h.world.at(6.0, stale_hello_then_look)

    assert h.run().state == RunState.SUCCEEDED
    assert seen == [WorkerState.STARTING]


def test_an_active_step_that_never_says_hello_times_out(make: Callable[..., Harness]) -> None:
    h = make(active=3, spares=1)
    h.world.hello_delay["c2"] = 1000.0

    result = h.run()

    assert (result.state, result.restarts) == (RunState.SUCCEEDED, 1)
    (fault,) = [e for e in h.events() if e.fields.get("detector") == "startup_timeout"]
    assert fault.fields["node"] == "c2"
    assert fault.ts - h.clock.WALL0 > CONFIG.startup_timeout
    assert h.supervisor.membership.active == ("c1", "c4", "c3")
