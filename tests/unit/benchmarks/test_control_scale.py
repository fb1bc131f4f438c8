"""benchmarks/experiments/control_scale.py: the pieces with logic (no sockets, no processes)."""

from __future__ import annotations

import time

import pytest

from benchmarks.experiments import control_scale as cs
from torchpass_slurm.control import messages
from torchpass_slurm.control.kinds import Kind

SECRET = b"s" * 32


@pytest.mark.parametrize("aggregate", [False, True])
def test_sign_makes_the_frames_encode_makes(aggregate: bool) -> None:
    beat = cs.Beat("n00007/0", tuple(range(56, 64)) if aggregate else (56,), 0.0)
    body = cs.heartbeat_body(beat, 12)
    ts = time.time()
    frames = cs.sign(SECRET, beat.sender, 1234567, ts, body)
    assert frames == messages.encode(messages.Message(Kind.HEARTBEAT, beat.sender, 1234567, ts, body), SECRET)
    decoded = messages.decode(frames, SECRET, allowed=messages.WORKER_KINDS)
    assert decoded.body == body


def test_beats_spread_over_the_interval_one_per_rank_or_one_per_node() -> None:
    per_rank = cs.beats_of(cs.Scenario("r", nodes=2))
    assert [b.sender for b in per_rank[:3]] == ["n00000/0", "n00000/1", "n00000/2"]
    assert per_rank[9].sender == "n00001/1" and per_rank[9].ranks == (9,)
    assert [b.phase for b in per_rank] == [i / 16 for i in range(16)]
    per_node = cs.beats_of(cs.Scenario("n", nodes=2, aggregate=True))
    assert [(b.sender, b.ranks) for b in per_node] == [
        ("n00000/0", tuple(range(8))),
        ("n00001/0", tuple(range(8, 16))),
    ]
    body = cs.heartbeat_body(per_node[1], 5)
    assert body == {
        "rank": 8,
        "step": 5,
        "state": "running",
        "tasks": [[k, 8 + k, 5, "running", round(250 * k / 8)] for k in range(1, 8)],
    }


def test_the_victim_is_local_rank_3_of_the_middle_node_or_that_node() -> None:
    assert (
        cs.beats_of(cs.Scenario("r", nodes=4))[cs.victim_of(cs.Scenario("r", nodes=4))].sender == "n00002/3"
    )
    node = cs.Scenario("n", nodes=4, aggregate=True)
    assert cs.beats_of(node)[cs.victim_of(node)].sender == "n00002/0"


def books(nodes: int) -> dict[str, cs.NodeBeats]:
    return {cs.node_name(n): cs.NodeBeats(cs.RANKS_PER_NODE) for n in range(nodes)}


def test_a_node_is_silent_only_once_every_task_was_heard_and_one_went_quiet() -> None:
    steps = books(2)
    for local in range(7):
        cs.on_message(steps, f"n00000/{local}", {"rank": local, "step": 3}, 10.0)
    assert cs.silent_nodes(steps, 20.0, 1.0) == []  # one task never heard: not judged yet (as WorkerStep)
    cs.on_message(steps, "n00000/7", {"rank": 7, "step": 4}, 10.5)
    assert steps["n00000"].last_step == 4
    assert cs.silent_nodes(steps, 11.0, 1.0) == []
    assert cs.silent_nodes(steps, 11.01, 1.0) == ["n00000"]  # the stalest task decides
    cs.on_message(steps, "n09999/0", {"rank": 0, "step": 1}, 11.0)  # not a node of the job: ignored
    assert set(steps) == {"n00000", "n00001"}


def test_an_aggregated_beat_counts_for_every_rank_it_lists_as_the_supervisor_does() -> None:
    steps = books(2)
    beat = cs.beats_of(cs.Scenario("n", nodes=2, aggregate=True))[1]
    cs.on_message(steps, beat.sender, cs.heartbeat_body(beat, 9), 5.0)
    node = steps["n00001"]
    assert node.heartbeats == {f"n00001/{k}": 5.0 - cs.relayed_age_ms(k) / 1000 for k in range(8)}
    assert node.silent_for(5.5) == pytest.approx(0.5 + 0.219)  # local 7's beat was 219 ms old
    assert node.last_step == 9 and node.phases["n00001/3"] == (9, "running")
    assert steps["n00000"].silent_for(5.5) is None
    cs.on_message(steps, beat.sender, cs.heartbeat_body(beat, 10), 4.0)  # older news: not taken
    assert node.heartbeats["n00001/7"] == pytest.approx(4.781) and node.phases["n00001/7"] == (9, "running")


def test_detection_is_the_victims_first_silence_after_its_last_beat() -> None:
    went_silent = [("n1", 9.0), ("n2", 10.2), ("n2", 11.3), ("n3", 12.5), ("n4", 30.0)]
    found, false = cs.detection(went_silent, "n2", 10.3, window_end=20.0)
    assert found == pytest.approx(1.0)
    assert false == 3  # n1, n2 before it stopped, n3; n4 went silent after the window
    assert cs.detection([], "n2", 10.3, 20.0) == (None, 0)


def test_percentile_and_the_rates_of_a_scenario() -> None:
    assert cs.percentile([], 0.5) is None
    assert cs.percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert cs.percentile([float(i) for i in range(101)], 0.99) == 99.0
    s = cs.Scenario("x", nodes=2048)
    assert (s.ranks, s.senders, s.offered_rate) == (16384, 16384, 65536.0)
    agg = cs.Scenario("x", nodes=2048, aggregate=True)
    assert (agg.senders, agg.offered_rate) == (2048, 8192.0)
    assert cs.generator_count(s) == 2 and cs.generator_count(cs.Scenario("x", nodes=4096)) == 4
    assert cs.ramp_interval(s) == pytest.approx(2.048) and cs.ramp_interval(agg) == pytest.approx(0.256)


def row(name: str, rate: float, cpu: float, main: float, check: float, **extra: object) -> dict[str, object]:
    scenario = {"name": name, "aggregate": False, "victim": True}
    return {
        "scenario": scenario,
        "offered_rate": 8192.0,
        "rate": rate,
        "cpu_share": cpu,
        "main_thread_share": main,
        "check_share": check,
        "cpu_us_per_msg": cpu / rate * 1e6,
        "latency_ms": {"p50": 0.4, "p99": 12.0, "max": 30.0},
        "detection_s": 1.02,
        "false_silences": 0,
        **extra,
    }


def test_the_tables_show_shares_and_split_a_message_cost() -> None:
    r = row("per-rank, 2,048 ranks", 8000.0, 0.40, 0.32, 0.08)
    text = cs.table([r])
    assert text.splitlines()[2] == (
        "| per-rank, 2,048 ranks | 8,192 | 8,000 | 40% | 32% | 8% | 50.0 | 0.4 / 12 | 1.02 | 0 |"
    )
    costs = {"per-rank decode": 12.0, "per-rank bookkeeping": 0.5}
    # per message: 50 us; I/O thread 10, main 40 = decode 12 + books 0.5 + check 10 + 17.5 rest
    assert cs.split_table([r], costs).splitlines()[2] == (
        "| per-rank, 2,048 ranks | 50.0 | 10.0 | 40.0 | 12.0 | 0.5 | 10.0 | 17.5 | 0.41 |"
    )
    assert cs.row_cells({"scenario": {"name": "x"}, "offered_rate": 1.0})[2] == "no window"
