"""benchmarks/experiments/control_scale*.py: the simulated job's messages, the faults' plan and
verdicts, the tables, and one tiny row of the real loop (4 nodes x 8 ranks, a few seconds)."""

from __future__ import annotations

import time

import pytest

from benchmarks.experiments import control_scale as cs
from benchmarks.experiments import control_scale_receive as receive
from benchmarks.experiments import control_scale_world as world
from benchmarks.experiments.control_scale_world import FaultKind, Injected, Row, Schedule
from torchpass_slurm.control import messages
from torchpass_slurm.control.kinds import Kind
from torchpass_slurm.control.rank_bodies import Heartbeat, TaskBeat
from torchpass_slurm.phase import Phase

SECRET = b"s" * 32
ORIGIN = 1000.0


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        (Kind.HEARTBEAT, world.node_beat_body(56, ORIGIN + 3.1, ORIGIN, 0.25)),
        (Kind.HEARTBEAT, world.standby_beat_body()),
        (Kind.HELLO, {"node": "n00007", "rank": 56, "local_rank": 0, "role": "active", "pid": 9, "epoch": 0}),
        (Kind.STANDBY, {"node": "n00007", "local_rank": 3, "pid": 9}),
        (Kind.REPORT, {"event": "live_ready", "fields": {"rank": 59, "step": 0}}),
    ],
)
def test_sign_makes_the_frames_encode_makes(kind: str, body: dict[str, object]) -> None:
    ts = time.time()
    frames = world.sign(SECRET, kind, "n00007/0", 1234567, ts, body)
    assert frames == messages.encode(messages.Message(kind, "n00007/0", 1234567, ts, body), SECRET)
    assert messages.decode(frames, SECRET, allowed=messages.WORKER_KINDS).body == body


def test_a_node_beat_is_what_local_rank_0_builds_with_each_rank_at_its_own_phase() -> None:
    t = ORIGIN + 3.1  # step 6, 0.1 s into it: computing
    body = world.node_beat_body(8, t, ORIGIN, 0.25)
    tasks = tuple(TaskBeat(*entry) for entry in body["tasks"])
    assert body == Heartbeat(rank=8, step=6, state=Phase.COMPUTE, tasks=tasks).to_body()
    assert [task.local_rank for task in tasks] == list(range(1, 8))
    assert [task.rank for task in tasks] == list(range(9, 16))
    # local rank k beats k/8 of an interval after local rank 0: its last beat is that old, or
    # an interval older once its turn is still to come
    assert [task.age_ms for task in tasks] == [68, 37, 6, 225, 193, 162, 131]
    assert all(task.alive for task in tasks)


@pytest.mark.parametrize(("kind", "alive"), [(FaultKind.RANK_DIED, False), (FaultKind.RANK_HUNG, True)])
def test_a_stopped_rank_keeps_its_last_entry_older_every_beat(kind: FaultKind, alive: bool) -> None:
    fault = Injected(kind, node=1, at=ORIGIN + 2.0, local=3)
    before = world.node_beat_body(8, ORIGIN + 1.9, ORIGIN, 0.25, fault)["tasks"][2]
    assert before[-1] is True
    last = world.last_local_beat(fault.at, ORIGIN, 3, 0.25)
    for t in (ORIGIN + 2.2, ORIGIN + 4.0):
        entry = world.node_beat_body(8, t, ORIGIN, 0.25, fault)["tasks"][2]
        assert entry == [
            3,
            11,
            world.step_at(last, ORIGIN),
            world.phase_at(last, ORIGIN),
            int((t - last) * 1000),
            alive,
        ]


def test_the_simulated_training_steps_every_half_second_computing_then_syncing() -> None:
    assert [world.step_at(ORIGIN + t, ORIGIN) for t in (0.0, 0.49, 0.5, 2.7)] == [0, 0, 1, 5]
    assert world.phase_at(ORIGIN + 0.1, ORIGIN) == Phase.COMPUTE
    assert world.phase_at(ORIGIN + 0.2, ORIGIN) == Phase.SYNC


def test_each_fault_strikes_its_own_node_the_ended_step_first() -> None:
    faults = world.fault_plan(Row("r", nodes=10), begin=50.0)
    assert sorted(f.at for f in faults)[0] == 50.0
    assert next(f for f in faults if f.at == 50.0).kind == FaultKind.AGENT_STEP_ENDED
    assert len({f.node for f in faults}) == len(faults) == len(FaultKind)
    schedule = Schedule(0.0, 7.0, 10.0, 50.0, faults)
    assert schedule.fault_of(faults[0].node) == faults[0]
    assert schedule.over == 50.0 + 6.0 + 7.0  # the dead agent, last, has heartbeat_timeout and slack
    assert Schedule(0.0, 7.0, 10.0, 50.0).over == 50.0
    small = world.fault_plan(Row("r", nodes=2, faults=(FaultKind.NODE_STOPPED, FaultKind.RANK_DIED)), 0.0)
    assert {f.node for f in small} == {0, 1}


def test_until_every_step_is_up_a_big_job_beats_slower_but_within_the_silence_threshold() -> None:
    assert world.ramp_interval(Row("r", nodes=256, spares=2)) == 0.25  # 288 senders: the row's own
    assert world.ramp_interval(Row("r", nodes=2048, spares=16)) == pytest.approx(2176 / 2500)
    assert world.ramp_interval(Row("r", nodes=9000)) == 0.9


def test_a_row_counts_its_heartbeat_senders() -> None:
    row = Row("r", nodes=2048, spares=16)
    assert (row.ranks, row.senders, row.offered_rate) == (16384, 2048 + 128, 8704.0)
    assert Row("r", nodes=256, per_node=False).offered_rate == 8192.0
    assert cs.generator_count(row) == 2 and cs.generator_count(Row("r", nodes=9000)) == 3


def detection(node: str, at: float, detector: str = "heartbeat_lost") -> dict[str, object]:
    return {
        "at": at,
        "action": "restart",
        "faults": [{"node": node, "detector": detector, "evidence": "probe", "detail": "silent"}],
    }


def test_a_fault_is_found_by_the_first_detection_on_its_node_after_it_struck() -> None:
    fault = Injected(FaultKind.NODE_STOPPED, node=2, at=20.0)
    schedule = Schedule(0.0, 7.0, 10.0, 19.0, (fault,))
    found = cs.detected([detection("n00002", 19.5), detection("n00002", 21.6)])
    row = cs.fault_row(fault, found, schedule, 0.25, sent=19.9)
    assert (row["found_s"], row["after_last_beat_s"], row["struck_s"]) == (1.6, 1.7, 10.0)
    assert (row["detector"], row["evidence"], row["plan"]) == ("heartbeat_lost", "probe", "restart")
    assert cs.fault_row(fault, [], schedule, 0.25, sent=19.9)["found_s"] is None
    rank = Injected(FaultKind.RANK_DIED, node=2, at=20.0, local=3)
    last = world.last_local_beat(20.0, 0.0, 3, 0.25)
    assert cs.fault_row(rank, found, schedule, 0.25, sent=None)["after_last_beat_s"] == round(21.6 - last, 3)


def test_false_detections_are_faults_on_nodes_not_struck_or_before_they_were() -> None:
    fault = Injected(FaultKind.NODE_STOPPED, node=2, at=20.0)
    result = {"plans": [detection("n00001", 12.0), detection("n00002", 15.0), detection("n00002", 21.5)]}
    result |= {"delays_s": [0.001, 0.002]}
    gens = [
        {"cpu_share": 0.1, "sent": 10, "refused": 0, "skipped": 0, "lateness_s": 0.01, "last_sent": {2: 19.9}}
    ]
    plan = cs.Plan(Row("r", nodes=4, faults=(FaultKind.NODE_STOPPED,)), 9.0)
    row = cs.summarise(plan, {"up": True}, Schedule(0.0, 7.0, 10.0, 19.0, (fault,)), result, gens)
    assert row["false_detections"] == ["n00001", "n00002"]
    assert row["faults"][0]["found_s"] == 1.5
    assert row["delay_ms"] == {"p50": 1.0, "p99": 2.0, "max": 2.0}


def test_the_tables_show_shares_detections_and_how_each_fault_was_found() -> None:
    faults = [
        {"kind": "stopped node", "found_s": 1.62, "after_last_beat_s": 1.8, "detector": "heartbeat_lost"}
        | {"evidence": "probe", "plan": "restart"},
        {"kind": "dead rank", "found_s": None},
    ]
    row = {
        "row": {"name": "2,048 x 8"},
        "offered_rate": 8704.0,
        "rate": 8700.0,
        "cpu_share": 0.412,
        "main_thread_share": 0.35,
        "cpu_us_per_msg": 47.4,
        "delay_ms": {"p50": 0.4, "p99": 12.0},
        "faults": faults,
        "false_detections": [],
    }
    assert cs.table([row]).splitlines()[2] == (
        "| 2,048 x 8 | 8,704 | 8,700 | 41.2% | 35.0% | 47.4 | 0.4 / 12 | 1.62 | missed | - | - | - | 0 |"
    )
    assert cs.fault_table([row]).splitlines()[2:] == [
        "| 2,048 x 8 | stopped node | 1.62 | 1.80 | heartbeat_lost | probe | restart |",
        "| 2,048 x 8 | dead rank | missed | - | - | - | - |",
    ]
    assert cs.row_cells({"row": {"name": "x"}, "offered_rate": 1.0})[2] == "no window"


def test_the_rows_of_a_full_run_and_of_a_quick_one() -> None:
    rows = cs.plans(2048, 30.0)
    assert [(p.row.nodes, p.row.spares, p.row.per_node, p.window_s, p.profile) for p in rows] == [
        (2048, 16, True, 30.0, False),
        (256, 2, True, 20.0, False),
        (256, 2, False, 20.0, False),
        (2048, 16, True, 15.0, True),
    ]
    assert FaultKind.AGENT_DIED not in rows[2].row.faults and rows[3].row.faults == ()
    assert [p.row.nodes for p in cs.plans(256, 20.0, quick=True)] == [256]


def test_a_tiny_job_under_the_real_loop_finds_its_stopped_node_and_nothing_else() -> None:
    """The whole machinery, so it cannot rot: processes, sockets, the real supervisor loop."""
    row = cs.run_row(cs.Plan(Row("tiny", nodes=4, spares=1, faults=(FaultKind.NODE_STOPPED,)), 2.0))
    assert row["up"]["up"], row["up"]
    assert row["false_detections"] == []
    (fault,) = row["faults"]
    assert fault["found_s"] is not None, fault
    assert (fault["detector"], fault["evidence"]) == ("heartbeat_lost", "probe")
    assert 1.0 < fault["after_last_beat_s"] < 3.0
    assert row["rate"] > 0 and row["rejected"] == 0 and row["generators"]["refused"] == 0


def test_the_loop_costs_time_every_piece_of_a_steady_tiny_job() -> None:
    costs = receive.loop_costs(4, repeat=1)
    assert set(costs) >= {"decode a node's beat (us)", "silence check (ms)", "status.json (ms)"}
    assert all(value > 0 for value in costs.values())
    assert receive.costs_table({4: costs}).splitlines()[2].startswith("| decode a node's beat (us) | ")
