"""Faults on active nodes and spares: who is blamed, who is promoted, who is relaunched."""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest

from torchpass_slurm import config as cfg
from torchpass_slurm.control import messages as msg
from torchpass_slurm.supervisor.loop import RunState
from torchpass_slurm.supervisor.workers import master_port

from .conftest import CONFIG, JOB_ID, Harness


@pytest.mark.parametrize("ntasks", [1, 2])
def test_a_crashed_rank_is_replaced_by_the_spare(make: Callable[..., Harness], ntasks: int) -> None:
    h = make(active=3, spares=1, ntasks=ntasks)
    h.world.crash("c2", 137, at=3.0)

    result = h.run()

    assert (result.state, result.exit_code, result.epoch, result.restarts) == (RunState.SUCCEEDED, 0, 1, 1)
    m = h.supervisor.membership
    assert (m.active, m.spares, m.failed) == (("c1", "c4", "c3"), (), ("c2",))
    assert h.promotes() == [
        {
            "to": f"c4/{i}",
            "rank": ntasks + i,
            "local_rank": i,
            "world_size": 3 * ntasks,
            "master_addr": "c1",
            "master_port": master_port(JOB_ID, 1),
            "epoch": 1,
            # no rendezvous store in these tests: the restart path, rank 0 hosts the rendezvous
            "mode": "restart",
            "store_addr": "",
            "store_port": 0,
        }
        for i in range(ntasks)
    ]
    assert h.launches()[4:] == [("c1", "active", 1), ("c3", "active", 1)]
    relaunched = {launch.node: launch.env for launch in h.slurm.launches[4:]}
    assert relaunched["c3"][cfg.ENV_RANK_BASE] == str(2 * ntasks)
    assert relaunched["c3"]["MASTER_PORT"] == str(master_port(JOB_ID, 1))
    old = {launch.node: launch.process for launch in h.slurm.launches[:4]}
    assert old["c1"].signals == old["c3"].signals == [signal.SIGTERM]  # epoch 0 survivors stopped
    assert h.launcher.stops[:2] == [(["c2"], CONFIG.lost_stop_timeout), (["c1", "c3"], CONFIG.stop_timeout)]

    kinds = h.kinds()
    fault_at = kinds.index("step_exited")
    assert kinds[fault_at : fault_at + 4] == [
        "step_exited",
        "spare_promoted",
        "migration_started",
        "restarted",
    ]
    fault, promoted, started, restarted = h.events()[fault_at : fault_at + 4]
    assert fault.fields == {
        "node": "c2",
        "role": "active",
        "detector": "step_exited",
        "exit_code": 137,
        "detail": "srun step on c2 exited with status 137",
        # its peers are not elastic (their steps exit too): judged by settling
        "evidence": "settled",
    }
    assert fault.ts - h.clock.WALL0 >= 3.0 + CONFIG.fault_settle  # blamed only after the settle
    assert (promoted.epoch, promoted.fields) == (
        1,
        {"node": "c4", "replaces": "c2", "ranks": list(range(ntasks, 2 * ntasks))},
    )
    assert (started.epoch, started.fields["mode"], started.fields["failed"]) == (1, "restart", ["c2"])
    assert (restarted.epoch, restarted.fields["restarts"]) == (1, 1)
    assert restarted.fields["active"] == ["c1", "c4", "c3"]
    ups = [e.fields["node"] for e in h.of_kind("worker_up") if e.epoch == 1]
    assert sorted(ups) == ["c1", "c3", "c4"]
    assert kinds[-1] == "finished" and h.of_kind("finished")[0].fields["restarts"] == 1

    status = h.status()
    nodes = {n.node: n for n in status.nodes}
    assert (status.state, status.epoch, status.restarts) == ("succeeded", 1, 1)
    assert (nodes["c2"].role, nodes["c2"].exit_code) == ("failed", 137)
    assert (nodes["c4"].role, nodes["c4"].ranks) == ("active", tuple(range(ntasks, 2 * ntasks)))


def test_a_dead_node_is_blamed_not_the_peer_whose_step_failed_after_it(make: Callable[..., Harness]) -> None:
    h = make(active=3, spares=1)
    h.world.go_silent("c2", at=2.0)  # the node dies: no heartbeats, srun hangs
    h.world.crash("c1", 1, at=2.5)  # c1's collective fails because c2 is gone

    result = h.run()

    assert (result.state, result.restarts) == (RunState.SUCCEEDED, 1)
    (lost,) = h.of_kind("heartbeat_lost")
    assert (lost.fields["node"], lost.fields["detector"]) == ("c2", "heartbeat_lost")
    assert "while srun step on c1 exited with status 1" in lost.fields["detail"]
    assert [e.fields for e in h.of_kind("step_exited") if e.fields["exit_code"] != 0] == []
    assert h.supervisor.membership.failed == ("c2",)
    assert h.supervisor.membership.active == ("c1", "c4", "c3")
    assert h.launches()[4:] == [("c1", "active", 1), ("c3", "active", 1)]
    c2 = h.slurm.launches[1].process
    assert c2.signals == [signal.SIGTERM, signal.SIGKILL]  # srun on a dead node is killed


def test_silence_alone_is_detected_after_the_heartbeat_timeout(make: Callable[..., Harness]) -> None:
    h = make(active=3, spares=1, train_s=12.0)
    h.world.go_silent("c2", at=2.0)

    result = h.run()

    assert (result.state, result.restarts) == (RunState.SUCCEEDED, 1)
    (lost,) = h.of_kind("heartbeat_lost")
    assert lost.fields["node"] == "c2" and lost.fields["detector"] == "heartbeat_lost"
    # c2's last heartbeat was sent at 1.5 s; the supervisor may stamp it up to one poll early
    detected = lost.ts - h.clock.WALL0
    assert 1.5 + CONFIG.heartbeat_timeout - 0.5 < detected <= 1.5 + CONFIG.heartbeat_timeout + 1.0
    assert h.launcher.stops[0] == (["c2"], CONFIG.lost_stop_timeout)
    assert h.promotes()[0]["rank"] == 1


def test_status_shows_a_silent_node_as_lost(make: Callable[..., Harness]) -> None:
    h = make(active=3, spares=1)
    h.world.go_silent("c2", at=2.0)

    h.run()

    c2 = next(n for n in h.status().nodes if n.node == "c2")
    assert (c2.role, c2.state) == ("failed", "lost")


def test_a_spare_that_dies_on_standby_shrinks_the_pool(make: Callable[..., Harness]) -> None:
    h = make(active=3, spares=2)
    h.world.crash("c4", 1, at=3.0)

    result = h.run()

    assert (result.state, result.exit_code, result.restarts) == (RunState.SUCCEEDED, 0, 0)
    m = h.supervisor.membership
    assert (m.active, m.spares, m.failed) == (("c1", "c2", "c3"), ("c5",), ("c4",))
    (lost,) = h.of_kind("spare_lost")
    assert lost.fields == {"node": "c4", "spares_left": 1}
    assert [e.fields["role"] for e in h.of_kind("step_exited") if e.fields.get("exit_code") == 1] == ["spare"]
    assert "restarted" not in h.kinds() and h.promotes() == []
    assert len(h.slurm.launches) == 5  # nothing relaunched
    assert h.stopped_senders() == ["c5/0"]


def test_a_spare_that_never_reports_is_dropped(make: Callable[..., Harness]) -> None:
    h = make(active=2, spares=1, train_s=15.0)
    h.world.hello_delay["c3"] = 1000.0

    result = h.run()

    assert (result.state, result.restarts) == (RunState.SUCCEEDED, 0)
    assert [e.fields["node"] for e in h.of_kind("spare_lost")] == ["c3"]
    assert h.supervisor.membership.spares == ()


def test_a_crash_with_no_spare_left_restarts_every_rank_in_place(make: Callable[..., Harness]) -> None:
    """The rank process died but Slurm still calls its node usable: restart from the checkpoint."""
    h = make(active=3, spares=0)
    h.world.crash("c2", 137, at=3.0)

    result = h.run()

    assert (result.state, result.exit_code, result.restarts, result.epoch) == (RunState.SUCCEEDED, 0, 1, 1)
    assert h.launches()[3:] == [("c1", "active", 1), ("c2", "active", 1), ("c3", "active", 1)]
    started = h.of_kind("migration_started")[0]
    assert (started.fields["mode"], started.fields["failed"]) == ("restart-in-place", ["c2"])
    assert h.of_kind("restarted")[0].fields["in_place"] is True
    assert "failed" not in h.kinds()
    assert h.slurm.shrinks == [] and "node_released" not in h.kinds()  # a crash leaves the node in the job


def test_a_second_fault_uses_the_second_spare(make: Callable[..., Harness]) -> None:
    h = make(active=2, spares=2)
    h.world.crash("c1", 9, at=2.0)
    h.world.at(8.0, lambda: h.world.current["c2"].process.exit(9))

    result = h.run()

    assert (result.state, result.epoch, result.restarts) == (RunState.SUCCEEDED, 2, 2)
    assert h.supervisor.membership.active == ("c3", "c4")
    assert [(p["to"], p["rank"], p["epoch"], p["master_addr"]) for p in h.promotes()] == [
        ("c3/0", 0, 1, "c3"),
        ("c4/0", 1, 2, "c3"),
    ]


def test_a_dead_node_without_spare_fails_with_status_1(make: Callable[..., Harness]) -> None:
    h = make(active=2, spares=0)
    h.world.go_silent("c2", at=2.0)

    result = h.run()

    assert (result.state, result.exit_code) == (RunState.FAILED, 1)
    assert "no hot spare left" in result.message


def test_a_spare_lost_while_an_active_node_starts_does_not_blame_it(make: Callable[..., Harness]) -> None:
    h = make(active=3, spares=1)
    h.world.hello_delay["c3"] = 5.0  # c3 is slow to import; c4 dies meanwhile
    h.world.crash("c4", 1, at=1.0)

    result = h.run()

    assert [e.fields["node"] for e in h.of_kind("spare_lost")] == ["c4"]
    assert [e.fields["node"] for e in h.events() if e.fields.get("detector")] == ["c4"]
    assert (result.state, result.restarts) == (RunState.SUCCEEDED, 0)


def test_a_spare_gone_at_promotion_does_not_crash_the_supervisor(make: Callable[..., Harness]) -> None:
    h = make(active=3, spares=2)
    h.world.crash("c2", 137, at=3.0)
    h.world.crash("c4", 1, at=3.0)  # the first spare dies in the same moment

    result = h.run()

    assert result.state == RunState.SUCCEEDED
    assert h.supervisor.membership.active == ("c1", "c5", "c3")


def test_a_spare_gone_at_the_end_does_not_fail_a_finished_training(make: Callable[..., Harness]) -> None:
    h = make(active=2, spares=1)

    def spare_task_leaves() -> None:  # its task exited; srun has not noticed yet
        h.world.silent.add("c3")
        h.server.disconnected.add(h.server.peer_of("c3/0") or b"")

    h.world.at(8.0, spare_task_leaves)

    result = h.run()

    assert (result.state, result.exit_code) == (RunState.SUCCEEDED, 0)


def test_a_promoted_spare_is_up_only_when_every_task_said_hello(make: Callable[..., Harness]) -> None:
    h = make(active=2, spares=1, ntasks=2)
    h.world.crash("c2", 137, at=2.0)
    seen: list[str] = []

    def on_promote(peer: bytes, message: msg.Message) -> None:
        if message.kind != msg.PROMOTE or message.body["local_rank"] != 1:
            return
        t = h.clock.elapsed

        def last_standby_beat_and_one_hello() -> None:
            h.server.inject(
                b"c3/1#1", "c3/1", msg.HEARTBEAT, {"rank": None, "step": None, "state": "standby"}
            )
            h.server.inject(
                b"c3/0#1",
                "c3/0",
                msg.HELLO,
                {"node": "c3", "rank": 2, "local_rank": 0, "role": "active", "pid": 1, "epoch": 1},
            )

        h.world.at(t + 1.0, last_standby_beat_and_one_hello)
        h.world.at(t + 2.0, lambda: seen.append(h.supervisor.steps["c3"].state.value))
        h.world.at(t + 2.5, lambda: h.world.hello_delay.pop("c3"))

    h.server.on_send.append(on_promote)
    # c3 says standby at 0.5 s; once promoted, its tasks stay quiet until on_promote speaks for them
    h.world.at(1.0, lambda: h.world.hello_delay.__setitem__("c3", 1000.0))

    h.run()

    assert seen == ["starting"]
