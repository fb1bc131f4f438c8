"""The Slurm watcher: DOWN / NOT_RESPONDING / FAIL nodes, nodes gone from the job, drains, errors."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from torchpass_slurm.errors import SlurmCommandError
from torchpass_slurm.supervisor.loop import RunState

from .conftest import CONFIG, Harness


@pytest.mark.parametrize(
    "state, flags", [("DOWN", ()), ("ALLOCATED", ("NOT_RESPONDING",)), ("MIXED", ("FAIL",))]
)
def test_a_node_slurm_reports_bad_is_replaced(
    make: Callable[..., Harness], state: str, flags: tuple[str, ...]
) -> None:
    h = make(active=3, spares=1)
    h.world.at(3.0, lambda: h.slurm.set_node("c3", state, *flags))

    result = h.run()

    assert (result.state, result.restarts) == (RunState.SUCCEEDED, 1)
    (down,) = h.of_kind("node_down")
    assert (down.fields["node"], down.fields["detector"]) == ("c3", "node_down")
    assert down.fields["role"] == "active"
    assert state in down.fields["detail"]
    assert down.ts - h.clock.WALL0 <= 3.0 + CONFIG.slurm_poll_interval + 0.5
    assert h.supervisor.membership.active == ("c1", "c2", "c4")
    assert [(p["to"], p["rank"]) for p in h.promotes()] == [("c4/0", 2)]
    assert h.launches()[4:] == [("c1", "active", 1), ("c2", "active", 1)]


def test_a_node_gone_from_the_job_is_replaced(make: Callable[..., Harness]) -> None:
    h = make(active=3, spares=1)
    h.world.at(3.0, lambda: h.slurm.job_nodes.remove("c3"))

    result = h.run()

    assert (result.state, result.restarts) == (RunState.SUCCEEDED, 1)
    (gone,) = h.of_kind("node_down")
    assert (gone.fields["node"], gone.fields["detector"]) == ("c3", "node_gone")
    assert "no longer lists c3 in job 4242" in gone.fields["detail"]
    assert h.supervisor.membership.failed == ("c3",)


def test_a_down_spare_shrinks_the_pool(make: Callable[..., Harness]) -> None:
    h = make(active=2, spares=1)
    h.world.at(3.0, lambda: h.slurm.set_node("c3", "DOWN"))

    result = h.run()

    assert (result.state, result.restarts) == (RunState.SUCCEEDED, 0)
    assert h.kinds().count("node_down") == 1 and h.kinds().count("spare_lost") == 1
    assert h.supervisor.membership.spares == ()


def test_a_drain_is_recorded_once_and_is_no_fault(make: Callable[..., Harness]) -> None:
    h = make(active=3, spares=1)
    h.world.at(2.0, lambda: h.slurm.set_node("c1", "MIXED", "DRAIN", reason="tp: bad gpu"))

    result = h.run()

    assert (result.state, result.restarts, result.epoch) == (RunState.SUCCEEDED, 0, 0)
    (drain,) = h.of_kind("drain_seen")
    assert drain.fields == {"node": "c1", "reason": "tp: bad gpu"}
    assert h.slurm.queries > 3  # polled many times while drained, recorded once


def test_slurm_is_polled_at_the_configured_interval(make: Callable[..., Harness]) -> None:
    h = make(active=2, spares=0)

    h.run()

    expected = h.clock.elapsed / CONFIG.slurm_poll_interval
    assert expected - 1 <= h.slurm.queries <= expected + 1


def test_a_failing_watcher_does_not_kill_the_job(
    make: Callable[..., Harness], caplog: pytest.LogCaptureFixture
) -> None:
    h = make(active=3, spares=1)
    h.slurm.error = SlurmCommandError(["squeue", "--json"], 1, "slurm_load_jobs error: Socket timed out")

    with caplog.at_level(logging.WARNING, logger="torchpass_slurm.supervisor.loop"):
        result = h.run()

    assert (result.state, result.exit_code, result.restarts) == (RunState.SUCCEEDED, 0, 0)
    assert h.slurm.queries > 3
    assert any(
        "Slurm watcher" in r.getMessage() and "Socket timed out" in r.getMessage() for r in caplog.records
    )
