"""benchmarks/campaign.py's pure parts: the seeded plan, matching faults to tp report's, the shares."""

from __future__ import annotations

import itertools

from benchmarks import campaign as c


def test_the_plan_is_a_function_of_the_seed_and_fits_each_job_s_spares() -> None:
    size = c.CampaignSizing()
    first, again = c.plan(50, 14, size), c.plan(50, 14, size)
    assert first == again
    assert c.plan(50, 15, size) != first
    faults = [f for job in first for f in job]
    assert [f.index for f in faults] == list(range(50))
    assert len(first) == 25 and all(len(job) <= size.spares for job in first)
    for job in first:  # each fault in its own window, inside the run
        steps = [f.step for f in job]
        assert steps == sorted(steps) and all(size.first_step <= s < size.steps for s in steps)
        assert all(b - a >= 4 for a, b in itertools.pairwise(steps))
    assert {f.fault_class for f in faults} == set(c.CLASSES)


def test_an_odd_count_leaves_the_last_job_one_fault() -> None:
    assert [len(job) for job in c.plan(5, 1, c.CampaignSizing())] == [2, 2, 1]


def test_each_injected_fault_takes_the_first_fault_found_on_its_node_after_it() -> None:
    injected = [{"node": "c2", "wall": 100.0}, {"node": "c3", "wall": 200.0}]
    found = [
        {"node": "c3", "time": 50.0},
        {"node": "c2", "time": 100.5},
        {"node": "c3", "time": 200.2},
        {"node": "c3", "time": 205.0},
    ]
    assert c.match(injected, found) == [found[1], found[2]]
    assert c.match([{"node": "c4", "wall": 1.0}], found) == [None]


def _record(cls: str, live: bool, data: bool = True, bitwise: bool = True) -> dict[str, object]:
    return {"class": cls, "live_no_lost_progress": live, "no_data_loss": data, "bitwise_equal": bitwise}


def test_totals_count_the_shares_per_class_and_bitwise_among_the_live_only() -> None:
    records = [
        _record("rank SIGKILL", True),
        _record("rank SIGKILL", True, bitwise=False),
        _record("admin drain", False, bitwise=False),
        _record("admin drain", True),
    ]
    t = c.totals(records)
    assert t["by_class"]["rank SIGKILL"]["share_live"] == 1.0
    assert t["by_class"]["rank SIGKILL"]["share_bitwise_among_live"] == 0.5
    assert t["by_class"]["admin drain"]["share_live"] == 0.5
    assert t["by_class"]["admin drain"]["share_bitwise_among_live"] == 1.0
    assert "node power-off" not in t["by_class"]
    assert t["all"] == {
        "faults": 4,
        "live_no_lost_progress": 3,
        "no_data_loss": 4,
        "bitwise_equal_among_live": 2,
        "share_live": 0.75,
        "share_no_data_loss": 1.0,
        "share_bitwise_among_live": 0.6667,
    }


def test_a_torchft_restart_from_step_0_counts_its_committed_steps_as_lost() -> None:
    from benchmarks.peers import rolled_back

    skew = [{"step": s} for s in (1, 1, 2, 3, 2, 3, 4)]  # groups log the same step a moment apart
    assert rolled_back(skew) == 0
    restart = [{"step": s} for s in (7, 8, 9, 1, 2, 14, 15)]  # from 9 back to 1, then healed to 14
    assert rolled_back(restart) == 9
