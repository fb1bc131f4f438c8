"""How fast and on what evidence a loss is declared, and what a fenced step can no longer do.

Conclusive evidence is acted on in the pass that sees it; silence is a loss
once a second signal confirms it (a peer's report naming the node, or its
slurmd not answering the probe); silence nothing confirms waits for the
heartbeat timeout; ambiguous evidence is settled (test_recovery.py,
test_live.py). The timings are virtual seconds (conftest.CONFIG).
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Callable

from torchpass_slurm.analysis.report import analyse
from torchpass_slurm.control import messages as msg
from torchpass_slurm.control.bodies import Report
from torchpass_slurm.control.messages import ReportKind
from torchpass_slurm.rundir import events as ev
from torchpass_slurm.supervisor.loop import POLL_SLICE, RunState

from .conftest import CONFIG, STORE, TRAIN_S, Harness, Live, at_of
from .fakes import ElasticRanks, FakeProbe, gloo_reset_by

#: One pass of the loop: the latest a fault may be judged after its evidence is there.
PASS = POLL_SLICE.total_seconds() + 1e-6


def fault_of(h: Harness) -> ev.Event:
    """The one fault event of the run."""
    (fault,) = [
        e
        for e in h.events()
        if e.kind in (ev.HEARTBEAT_LOST, ev.STEP_EXITED, ev.NODE_DOWN) and e.fields.get("exit_code") != 0
    ]
    return fault


def assert_one_live_migration(h: Harness, failed: str) -> None:
    assert h.supervisor.state == RunState.SUCCEEDED
    (started,) = h.of_kind(ev.MIGRATION_STARTED)
    assert (started.fields["mode"], started.fields["failed"]) == ("live", [failed])
    assert [d.fields["resolution"] for d in h.of_kind(ev.MIGRATION_DONE)] == ["live"]


def probe_of(h: Harness) -> FakeProbe:
    assert h.probe is not None
    return h.probe


def test_a_killed_rank_of_an_elastic_job_is_blamed_in_the_pass_that_sees_its_exit(live: Live) -> None:
    h, _ = live()
    h.world.crash("c2", 137, at=3.0)

    h.run()

    fault = fault_of(h)
    assert (fault.kind, fault.fields["node"], fault.fields["evidence"]) == (
        ev.STEP_EXITED,
        "c2",
        "conclusive",
    )
    assert 3.0 <= at_of(h, fault) <= 3.0 + PASS  # no settle: elastic peers never exit for it
    assert_one_live_migration(h, "c2")


def test_a_silent_node_named_by_a_peer_is_blamed_once_past_the_silence_threshold(live: Live) -> None:
    h, ranks = live(probe=True)
    probe_of(h).latency = 10.0  # the probe would answer far too late: the peer's word decides
    h.world.go_silent("c2", at=3.0)  # power cut: its peers' connections are reset
    ranks.fail_collective("c1", at=3.1, error=gloo_reset_by("c2"))

    h.run()

    fault = fault_of(h)
    assert (fault.kind, fault.fields["node"], fault.fields["evidence"]) == (
        ev.HEARTBEAT_LOST,
        "c2",
        "peer-report",
    )
    assert "named by rank 0 on c1" in fault.fields["detail"]
    assert at_of(h, fault) <= 3.0 + CONFIG.silence_threshold + 2 * PASS
    assert_one_live_migration(h, "c2")


def test_a_silent_node_whose_slurmd_does_not_answer_is_blamed_by_the_probe(live: Live) -> None:
    h, _ = live(probe=True)
    probe = probe_of(h)
    probe.gone.add("c2")
    h.world.go_silent("c2", at=3.0)  # cut off the network: nobody's collective fails yet

    h.run()

    fault = fault_of(h)
    assert (fault.kind, fault.fields["node"], fault.fields["evidence"]) == (ev.HEARTBEAT_LOST, "c2", "probe")
    assert at_of(h, fault) <= 3.0 + CONFIG.silence_threshold + probe.latency + 2 * PASS
    assert [n for _, n in probe.started] == ["c2"]  # only the silent node was probed
    assert_one_live_migration(h, "c2")
    # the recovery started in the same pass: nobody waited for the dead node's srun to stop
    (started,) = h.of_kind(ev.MIGRATION_STARTED)
    assert at_of(h, started) == at_of(h, fault)
    srun = next(launch.process for launch in h.slurm.launches if launch.node == "c2")
    assert srun.signals == [signal.SIGTERM, signal.SIGKILL]  # it ignored SIGTERM; killed later


def test_silence_that_nothing_confirms_waits_for_the_heartbeat_timeout(live: Live) -> None:
    h, _ = live(probe=True)  # c2's slurmd answers: its process is frozen, not its node
    h.world.go_silent("c2", at=3.0)

    h.run()

    fault = fault_of(h)
    assert (fault.kind, fault.fields["node"], fault.fields["evidence"]) == (
        ev.HEARTBEAT_LOST,
        "c2",
        "timeout",
    )
    assert (
        3.0 + CONFIG.heartbeat_timeout - PASS <= at_of(h, fault) <= 3.0 + CONFIG.heartbeat_timeout + 2 * PASS
    )
    assert_one_live_migration(h, "c2")


def test_a_short_silence_on_a_loaded_host_is_no_fault(live: Live) -> None:
    h, _ = live(probe=True)
    h.world.at(3.0, lambda: h.world.silent.add("c2"))
    h.world.at(3.0 + CONFIG.silence_threshold + 1.0, lambda: h.world.silent.discard("c2"))

    result = h.run()

    assert (result.state, result.epoch) == (RunState.SUCCEEDED, 0)
    assert not h.of_kind(ev.MIGRATION_STARTED) and not h.of_kind(ev.HEARTBEAT_LOST)
    assert [n for _, n in probe_of(h).started] == ["c2"]


def test_a_fenced_step_that_speaks_again_moves_nothing(live: Live) -> None:
    """A partitioned node comes back after its ranks moved: its old rank's heartbeats and its
    report of the collective that failed long ago start no recovery; it is told to stop, once."""
    h, _ = live(probe=True)
    probe_of(h).gone.add("c2")
    h.world.go_silent("c2", at=3.0)
    zombie = b"c2/0#1"

    def wake() -> None:
        h.server.disconnected.discard(zombie)  # the partition healed; it reconnects
        for _ in range(3):
            h.server.inject(zombie, "c2/0", msg.HEARTBEAT, {"rank": 1, "step": 3, "state": "training"})
        failed = Report.of(ReportKind.COLLECTIVE_FAILED, rank=1, step=3, epoch=0, error=gloo_reset_by("c1"))
        h.server.inject(zombie, "c2/0", msg.REPORT, failed.to_body())

    h.world.at(9.0, wake)

    result = h.run()

    assert (result.state, result.epoch) == (RunState.SUCCEEDED, 1)
    assert len(h.of_kind(ev.MIGRATION_STARTED)) == 1  # no regroup on a zombie's word
    (fenced,) = h.of_kind(ev.FENCED)
    assert fenced.fields == {"node": "c2", "sender": "c2/0", "message_kind": "heartbeat"}
    assert at_of(h, fenced) >= 9.0
    stops = [s for s in h.server.sent_of(msg.STOP) if s.peer == zombie]
    assert len(stops) == 1 and "fenced" in stops[0].message.body["reason"]


def test_a_survivors_report_of_an_epoch_already_recovered_is_old_news(live: Live) -> None:
    h, _ = live(probe=True)
    probe_of(h).gone.add("c2")
    h.world.go_silent("c2", at=3.0)
    # c1 was stuck in epoch 0's collective; it says so after the job moved to epoch 1
    stale = Report.of(ReportKind.COLLECTIVE_FAILED, rank=0, step=3, epoch=0, error=gloo_reset_by("c2"))
    h.world.at(9.0, lambda: h.server.inject(b"c1/0#1", "c1/0", msg.REPORT, stale.to_body()))

    result = h.run()

    assert (result.state, result.epoch) == (RunState.SUCCEEDED, 1)
    assert len(h.of_kind(ev.MIGRATION_STARTED)) == 1


def test_a_recovery_that_cannot_finish_goes_back_to_the_planner(make: Callable[..., Harness]) -> None:
    """The survivors never agree in epoch 1 (a rank that will never come): after
    recovery_timeout every rank restarts in place from the checkpoint, and the job ends."""
    h = make(train_s=TRAIN_S, store=STORE, config=dataclasses.replace(CONFIG, recovery_timeout=10))
    ranks = ElasticRanks(h.world)
    ranks.stall.add(1)
    h.world.go_silent("c2", at=3.0)
    ranks.fail_collective("c1", at=3.1, error=gloo_reset_by("c2"))

    result = h.run()

    assert (result.state, result.restarts) == (RunState.SUCCEEDED, 1)
    live, in_place = h.of_kind(ev.MIGRATION_STARTED)
    assert (live.fields["mode"], in_place.fields["mode"]) == ("live", "restart-in-place")
    assert at_of(h, in_place) - at_of(h, live) >= 10
    (restarted,) = h.of_kind(ev.RESTARTED)
    assert restarted.fields["active"] == ["c1", "c4", "c3"]  # the promoted spare is relaunched too
    assert h.launches()[4:] == [("c1", "active", 2), ("c4", "active", 2), ("c3", "active", 2)]
    assert not [d for d in h.of_kind(ev.MIGRATION_DONE) if d.fields["resolution"] == "live"]


def test_a_live_move_that_fell_back_to_a_restart_reports_the_chains_steps_once(
    make: Callable[..., Harness],
) -> None:
    """Issue 24, item 6: the stalled live move of c2's ranks is continued by the restart in
    place (``chained_from``), and the restart's ``migration_done`` counts the chain's lost and
    recomputed steps from the high mark before the first fault. The report has one recovery
    for the fault, with its numbers known."""
    h = make(train_s=TRAIN_S, store=STORE, config=dataclasses.replace(CONFIG, recovery_timeout=10))
    ranks = ElasticRanks(h.world)
    ranks.stall.add(1)
    h.world.go_silent("c2", at=3.0)
    ranks.fail_collective("c1", at=3.1, error=gloo_reset_by("c2"))
    h.world.report("c1", "resumed", at=22.0, step=1, epoch=2)  # rank 0 of the relaunched c1

    assert h.run().state == RunState.SUCCEEDED

    live, in_place = h.of_kind(ev.MIGRATION_STARTED)
    assert "chained_from" not in live.fields and in_place.fields["chained_from"] == live.epoch == 1
    (done,) = h.of_kind(ev.MIGRATION_DONE)
    high_mark = live.fields["committed_step"]
    assert {k: done.fields[k] for k in ("resolution", "lost_steps", "recomputed_steps", "failed")} == {
        "resolution": "checkpoint",
        "lost_steps": high_mark - 1,
        "recomputed_steps": high_mark - 1,
        "failed": ["c2"],
    }
    assert done.fields["seconds"] >= at_of(h, done) - at_of(h, live) - 0.01  # from the first start
    (fault,) = analyse(h.events()).faults
    assert (fault.node, fault.resolution, fault.lost_steps, fault.recomputed_steps) == (
        "c2",
        "checkpoint",
        high_mark - 1,
        high_mark - 1,
    )


def test_a_rank_that_said_bye_may_take_its_time_to_exit(live: Live) -> None:
    """At the end of the training a rank says bye and stops beating; tearing down torch
    can take seconds more before its step exits. That silence is not a fault."""
    h, _ = live(probe=True)
    exit_at = 3.0 + CONFIG.heartbeat_timeout + 2.0

    def leave() -> None:
        h.server.inject(b"c2/0#1", "c2/0", msg.BYE, {})
        h.world.silent.add("c2")

    h.world.at(3.0, leave)
    h.world.crash("c2", 0, at=exit_at)

    result = h.run()

    assert (result.state, result.epoch) == (RunState.SUCCEEDED, 0)
    assert not h.of_kind(ev.HEARTBEAT_LOST) and not h.of_kind(ev.MIGRATION_STARTED)
    (exited,) = [e for e in h.of_kind(ev.STEP_EXITED) if e.fields["node"] == "c2"]
    assert exited.fields["exit_code"] == 0 and at_of(h, exited) >= exit_at
