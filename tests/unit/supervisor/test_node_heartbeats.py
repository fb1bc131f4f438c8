"""Per-node heartbeats (``TORCHPASS_NODE_HEARTBEAT=1``): local rank 0 of each node sends one
heartbeat whose ``tasks`` carry its node's other ranks, and the supervisor judges every rank
by its own last beat as before: the same thresholds, the same evidence.

Each timing test runs both ways, per rank and per node, on the virtual clock (conftest.CONFIG).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from torchpass_slurm import config as cfg
from torchpass_slurm.control.messages import ReportKind
from torchpass_slurm.control.rank_bodies import TaskBeat
from torchpass_slurm.rundir import events as ev
from torchpass_slurm.supervisor.loop import RunState
from torchpass_slurm.supervisor.membership import Membership
from torchpass_slurm.supervisor.workers import StepLauncher, WorkerStep

from .conftest import CONFIG, Harness, Live, at_of
from .fakes import GLOO_RESET, FakeProcess, FakeSlurm, VirtualClock
from .test_detection import PASS, assert_one_live_migration, fault_of, probe_of

MODES = pytest.mark.parametrize("node_beats", [False, True], ids=["per-rank", "per-node"])
FAULTS = (
    ev.HEARTBEAT_LOST,
    ev.RANK_HUNG,
    ev.STEP_EXITED,
    ev.NODE_DOWN,
    ev.SPARE_LOST,
    ev.RESTARTED,
    ev.FAILED,
)


def test_a_healthy_job_with_node_beats_has_no_fault_and_every_rank_is_heard(
    make: Callable[..., Harness],
) -> None:
    h = make(active=3, spares=1, ntasks=2, node_beats=True)
    h.world.phase["c2"] = "sync"
    heard: dict[str, tuple[float, tuple[int | None, str]]] = {}

    def look() -> None:
        step = h.supervisor.steps["c2"]
        heard.update({"c2/1": (step.heartbeats["c2/1"], step.phases["c2/1"])})

    h.world.at(5.0, look)

    result = h.run()

    assert result.state == RunState.SUCCEEDED
    assert not [e for e in h.events() if e.kind in FAULTS and e.fields.get("exit_code") != 0]
    last, (step, phase) = heard["c2/1"]
    assert h.clock.WALL0 + 5.0 - 2 * PASS <= last <= h.clock.WALL0 + 5.0  # relayed, a tick old at most
    assert phase == "sync" and step is not None and step >= 3


def test_only_local_rank_0_beats_to_the_supervisor(make: Callable[..., Harness]) -> None:
    h = make(active=2, spares=0, ntasks=3, node_beats=True)
    beats: list[tuple[str, dict[str, object]]] = []
    inject = h.server.inject

    def record(peer: bytes, sender: str, kind: str, body: dict[str, object]) -> None:
        if kind == "heartbeat":
            beats.append((sender, body))
        inject(peer, sender, kind, body)

    h.server.inject = record  # type: ignore[method-assign]

    h.run()

    assert beats and {s for s, _ in beats} == {"c1/0", "c2/0"}
    _sender, body = beats[-1]
    assert [t[:4] for t in body["tasks"]] == [[1, 4, 8, "training"], [2, 5, 8, "training"]]  # type: ignore[index]


def one_fault(h: Harness) -> ev.Event:
    (fault,) = [e for e in h.events() if e.kind in FAULTS and e.fields.get("exit_code") != 0]
    return fault


@MODES
def test_one_quiet_task_is_lost_after_the_heartbeat_timeout(live: Live, node_beats: bool) -> None:
    """Its node still answers (the probe), so only the timeout confirms: in both modes alike.
    Per node, local rank 0 beats on and says the quiet task's process lives: that rank is hung,
    its node is not silent, and there is nothing to probe."""
    h, _ = live(probe=True, ntasks=2, node_beats=node_beats)
    h.world.go_quiet("c2/1", at=3.0)  # per node: c2/0 keeps sending c2/1's entry, older each time

    h.run()

    fault = one_fault(h)
    kind = ev.RANK_HUNG if node_beats else ev.HEARTBEAT_LOST
    assert (fault.kind, fault.fields["node"], fault.fields["evidence"]) == (kind, "c2", "timeout")
    assert (
        3.0 + CONFIG.heartbeat_timeout - PASS <= at_of(h, fault) <= 3.0 + CONFIG.heartbeat_timeout + 2 * PASS
    )
    if node_beats:
        assert "c2/1 silent for" in fault.fields["detail"] and "its process lives" in fault.fields["detail"]
        assert not probe_of(h).started
    else:
        assert probe_of(h).started and probe_of(h).started[0][1] == "c2"
        assert (
            3.0 + CONFIG.silence_threshold - PASS
            <= probe_of(h).started[0][0]
            <= (3.0 + CONFIG.silence_threshold + 2 * PASS)
        )
    assert_one_live_migration(h, "c2")


def test_a_task_whose_process_died_behind_its_nodes_beats_is_lost_at_the_silence_threshold(
    live: Live,
) -> None:
    """Local rank 0 says the task's process is gone: that is the second signal, no probe and no
    timeout needed (the node itself answers and beats)."""
    h, _ = live(probe=True, ntasks=2, node_beats=True)
    h.world.kill_task("c2/1", at=3.0)

    h.run()

    fault = one_fault(h)
    assert (fault.kind, fault.fields["node"], fault.fields["evidence"]) == (
        ev.HEARTBEAT_LOST,
        "c2",
        "local-report",
    )
    assert "c2/1" in fault.fields["detail"] and "its process is gone" in fault.fields["detail"]
    assert 3.0 + CONFIG.silence_threshold <= at_of(h, fault) <= 3.0 + CONFIG.silence_threshold + 2 * PASS
    assert not probe_of(h).started
    assert_one_live_migration(h, "c2")


TEARDOWN = dataclasses.replace(CONFIG, teardown_timeout=9.0)


@MODES
def test_a_rank_silent_in_its_teardown_is_given_the_teardown_timeout_not_its_node_lost(
    make: Callable[..., Harness], node_beats: bool
) -> None:
    """Issue 21: local rank 1 reports its failed collective, then its heartbeat thread starves
    for 7 s (the teardown holds the GIL) while local rank 0 beats on: no node is lost for it,
    and once it beats again nothing is blamed at all."""
    h = make(active=3, spares=1, ntasks=2, node_beats=node_beats, train_s=20.0, config=TEARDOWN)
    h.world.report(
        "c2", ReportKind.COLLECTIVE_FAILED, at=3.0, local=1, rank=3, step=3, epoch=0, error=GLOO_RESET
    )
    h.world.go_quiet("c2/1", at=3.0)
    h.world.at(10.0, lambda: h.world.quiet.discard("c2/1"))

    h.run()

    assert TEARDOWN.heartbeat_timeout < 7.0 < TEARDOWN.teardown_timeout
    assert not [e for e in h.events() if e.kind in FAULTS and e.fields.get("exit_code") != 0]
    assert h.supervisor.state == RunState.SUCCEEDED


@MODES
def test_a_rank_stuck_in_its_teardown_past_the_teardown_timeout_is_hung_on_its_own(
    make: Callable[..., Harness], node_beats: bool
) -> None:
    h = make(active=3, spares=1, ntasks=2, node_beats=node_beats, train_s=20.0, config=TEARDOWN)
    h.world.report(
        "c2", ReportKind.COLLECTIVE_FAILED, at=3.0, local=1, rank=3, step=3, epoch=0, error=GLOO_RESET
    )
    h.world.go_quiet("c2/1", at=3.0)

    h.run()

    fault, *_ = [e for e in h.events() if e.kind in FAULTS]  # then the recovery (no store: a restart)
    assert (fault.kind, fault.fields["node"], fault.fields["evidence"]) == (ev.RANK_HUNG, "c2", "timeout")
    assert (
        "c2/1 silent for" in fault.fields["detail"]
        and "since its collective failed" in fault.fields["detail"]
    )
    assert (
        3.0 + TEARDOWN.teardown_timeout - PASS
        <= at_of(h, fault)
        <= 3.0 + TEARDOWN.teardown_timeout + 2 * PASS
    )


@MODES
def test_a_dead_node_is_lost_by_the_probe_after_the_silence_threshold(live: Live, node_beats: bool) -> None:
    h, _ = live(probe=True, ntasks=2, node_beats=node_beats)
    probe_of(h).gone.add("c2")
    h.world.go_silent("c2", at=3.0)

    h.run()

    fault = fault_of(h)
    assert (fault.kind, fault.fields["node"], fault.fields["evidence"]) == (ev.HEARTBEAT_LOST, "c2", "probe")
    latest = 3.0 + CONFIG.silence_threshold + probe_of(h).latency + 3 * PASS
    assert 3.0 + CONFIG.silence_threshold <= at_of(h, fault) <= latest
    assert_one_live_migration(h, "c2")


# --- WorkerStep.relayed ------------------------------------------------------------------------


def step_of(ntasks: int = 3) -> WorkerStep:
    return WorkerStep(
        node="c1",
        role=cfg.NodeRole.ACTIVE,
        epoch=0,
        ntasks=ntasks,
        process=FakeProcess(VirtualClock()),
        started=0.0,
    )  # type: ignore[arg-type]


def test_a_relayed_task_is_heard_age_ms_before_the_beat_never_later_than_recorded() -> None:
    step = step_of()
    step.seen("c1/0", 100.0, 7, "sync")
    step.relayed("c1/0", (TaskBeat(1, 1, 7, "sync", 250), TaskBeat(2, 2, 6, "compute", 0)), 100.0)
    assert step.heartbeats == {"c1/0": 100.0, "c1/1": 99.75, "c1/2": 100.0}
    assert step.phases["c1/1"] == (7, "sync") and step.phases["c1/2"] == (6, "compute")
    step.seen("c1/1", 101.0, 8, "compute")  # heard directly later (its hello, a direct beat)
    step.relayed("c1/0", (TaskBeat(1, 1, 7, "sync", 900),), 101.5)  # an older beat: 100.6
    assert step.heartbeats["c1/1"] == 101.0 and step.phases["c1/1"] == (8, "compute")
    step.relayed("c1/0", (TaskBeat(1, 1, 9, "sync", 100),), 102.0)
    assert step.heartbeats["c1/1"] == pytest.approx(101.9) and step.phases["c1/1"] == (9, "sync")
    assert step.last_step == 9


def test_a_relayed_entry_outside_the_step_or_of_the_relay_itself_is_ignored() -> None:
    step = step_of(ntasks=2)
    step.seen("c1/1", 100.0, 5, "sync")
    step.relayed(
        "c1/1",
        (TaskBeat(1, 1, 9, "compute", 0), TaskBeat(2, 2, 9, "compute", 0), TaskBeat(7, 7, 9, "compute", 0)),
        101.0,
    )
    assert step.heartbeats == {"c1/1": 100.0} and step.phases["c1/1"] == (5, "sync")
    assert step.last_step == 5


def test_a_task_quiet_behind_its_relay_grows_silent() -> None:
    step = step_of(ntasks=2)
    for t in (10.0, 10.25, 10.5, 10.75, 11.0):
        step.seen("c1/0", t, 3, "sync")
        step.relayed("c1/0", (TaskBeat(1, 1, 3, "sync", round((t - 10.0) * 1000)),), t)  # last beat at 10.0
    assert step.silent_for(11.0) == pytest.approx(1.0)


def test_a_step_whole_at_last_is_silent_from_then_not_from_its_first_hello() -> None:
    """Local rank 1 said hello 11 s before local rank 0 (a loaded host): it beats through local
    rank 0, which could not relay before it was up. The step was silent for 11.1 s the moment
    it was whole, and lost on the dev cluster; silence now counts from its last hello."""
    step = step_of(ntasks=2)
    step.seen("c1/1", 312.9)  # hello of local rank 1
    step.seen("c1/0", 324.0)  # hello of local rank 0, 11.1 s later
    assert step.silent_for(324.0) == pytest.approx(11.1)
    step.all_up(324.0)
    assert step.silent_for(324.0) == 0.0
    assert step.silent_for(330.0) == pytest.approx(6.0)  # and it grows as before


# --- StepLauncher -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("active", "spares", "threshold", "expected"),
    [
        (3, 1, 4, "1"),  # 4 nodes, spares counted
        (3, 0, 4, "0"),
        (4, 2, 256, "0"),  # the default
        (1, 0, 1, "1"),
    ],
)
def test_steps_get_node_heartbeats_from_the_node_threshold_on(
    active: int, spares: int, threshold: int, expected: str
) -> None:
    clock = VirtualClock()
    nodes = [f"c{i}" for i in range(1, active + spares + 1)]
    slurm = FakeSlurm(clock, nodes)
    launcher = StepLauncher(
        slurm,
        job_id=7,
        command=("python", "train.py"),  # type: ignore[arg-type]
        control_endpoint="tcp://batch:5555",
        base_env={cfg.ENV_NODE_HEARTBEAT: "1"},
        clock=clock,
        heartbeat_per_node_from=threshold,
    )
    membership = Membership.initial(nodes, active, 2)
    for node in nodes:
        launcher.launch(node, membership)
    assert [launch.env[cfg.ENV_NODE_HEARTBEAT] for launch in slurm.launches] == [expected] * len(nodes)


def test_the_threshold_comes_from_the_environment_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHPASS_HEARTBEAT_PER_NODE_FROM", "3")
    clock = VirtualClock()
    launcher = StepLauncher(
        FakeSlurm(clock, ["c1"]),
        job_id=7,
        command=("x",),  # type: ignore[arg-type]
        control_endpoint="tcp://b:1",
        base_env={},
        clock=clock,
    )
    assert launcher.heartbeat_per_node_from == 3
    monkeypatch.delenv("TORCHPASS_HEARTBEAT_PER_NODE_FROM")
    assert cfg.SupervisorConfig.from_env().heartbeat_per_node_from == 256


@MODES
def test_a_node_silent_in_its_teardown_is_not_lost_because_a_peer_names_it(
    live: Live, node_beats: bool
) -> None:
    """The survivors shut their sockets down first, so another survivor's error names them: on
    the dev cluster the healthy batch host was lost by "peer-report" 1.8 s into its ranks'
    teardown. A node whose silent tasks last said their collective failed is judged by the
    probe (it answers) and the teardown timeout, never by a peer naming it."""
    h, _ = live(probe=True, ntasks=2, node_beats=node_beats)
    for local in (0, 1):
        h.world.report(
            "c2",
            ReportKind.COLLECTIVE_FAILED,
            at=3.0,
            local=local,
            rank=2 + local,
            step=3,
            epoch=0,
            error=GLOO_RESET,
        )
        h.world.go_quiet(f"c2/{local}", at=3.0)
    h.world.report(
        "c3",
        ReportKind.COLLECTIVE_FAILED,
        at=3.1,
        rank=4,
        step=3,
        epoch=0,
        error=f"{GLOO_RESET} [10.0.0.2]:4242",
    )  # c2's address (FakeProbe.node_of_address)
    h.world.at(8.0, lambda: h.world.quiet.difference_update({"c2/0", "c2/1"}))

    h.run()

    assert not [
        e
        for e in h.events()
        if e.kind in FAULTS and e.fields.get("exit_code") != 0 and e.fields.get("node") == "c2"
    ]
