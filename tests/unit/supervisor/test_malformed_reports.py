"""Signed reports with mistyped fields (a buggy rank): dropped with a warning, never in the event log."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest

from torchpass_slurm.control import messages as msg
from torchpass_slurm.rundir import events as ev
from torchpass_slurm.supervisor.loop import RunState

from .conftest import Harness

BAD_REPORTS: list[tuple[str, dict[str, Any]]] = [
    ("agreement", {"rank": 0, "committed_step": 3, "epoch": "1"}),
    ("group_rebuilt", {"rank": 0, "seconds": 0.1, "epoch": [1]}),
    ("first_step", {"rank": 0, "epoch": 1}),  # no step
    ("resumed", {"rank": 0, "step": "3", "epoch": 1}),
    ("collective_failed", {"rank": 0, "step": 3, "error": "x", "epoch": None}),
    ("no_such_event", {"rank": 0}),
]


def test_malformed_reports_are_dropped_and_the_job_and_its_log_stay_whole(
    make: Callable[..., Harness], caplog: pytest.LogCaptureFixture
) -> None:
    h = make(active=2, spares=1)

    def inject() -> None:
        peer = h.server.peer_of("c1/0") or b""
        for event, fields in BAD_REPORTS:
            h.server.inject(peer, "c1/0", msg.REPORT, {"event": event, "fields": fields})

    h.world.at(3.0, inject)
    with caplog.at_level(logging.WARNING, logger="torchpass_slurm.supervisor.loop"):
        result = h.run()

    assert (result.state, result.exit_code, result.epoch, result.restarts) == (RunState.SUCCEEDED, 0, 0, 0)
    kinds = h.kinds()  # read back through read_events: every line is a valid event
    assert kinds == ["started"] + ["worker_up"] * 3 + ["step_exited"] * 2 + ["finished"]
    dropped = [r.getMessage() for r in caplog.records if "malformed report" in r.getMessage()]
    assert len(dropped) == len(BAD_REPORTS)
    assert all(isinstance(e.epoch, int) for e in ev.read_events(h.run_dir / ev.EVENTS_FILE))
