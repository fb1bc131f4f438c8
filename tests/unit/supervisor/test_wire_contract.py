"""Contract: what the simulated ranks send is what the real control plane accepts and the
supervisor reads, built with the same typed bodies as the rank side (``control/rank_bodies.py``,
``control/reports.py``).

Every message :class:`~.fakes.World` and :class:`~.fakes.ElasticRanks` inject in a live
migration, a pre-emptive drain and a job with per-node heartbeats is signed, put through the
real :func:`~torchpass_slurm.control.messages.decode` of the supervisor's socket, and read back
with the class the supervisor reads it with. A fake that drifted from the wire would pass its
own tests and prove nothing: this is the test that fails instead.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest

from torchpass_slurm.control import messages as m
from torchpass_slurm.control.kinds import Kind, ReportKind
from torchpass_slurm.control.rank_bodies import Heartbeat
from torchpass_slurm.control.reports import Report
from torchpass_slurm.supervisor.loop import RunState

from .conftest import Harness, Live
from .fakes import SECRET


def decoded_kinds(h: Harness) -> Counter[str]:
    """Decode every injected message as the supervisor's socket does; count their kinds (a
    report counts as its event)."""
    assert h.world.malformed_sent == 0, "a well-behaved fake sent a report its typed class refuses"
    seen: Counter[str] = Counter()
    guard = m.ReplayGuard()
    for sent in h.server.injected:
        frames = m.encode(sent, SECRET)
        msg = m.decode(
            frames, SECRET, allowed=m.WORKER_KINDS, guard=guard, now=sent.ts, recipient=m.SUPERVISOR
        )
        assert msg == sent
        typed = m.BODY_TYPES[msg.kind].from_body(msg.body)  # the class decode checks it with
        assert typed.to_body() == dict(msg.body)  # nothing lost or added on the way
        if msg.kind == Kind.REPORT:  # and its fields, with the class the supervisor reads them with
            report = Report.from_body(msg.body)
            assert report.to_body() == dict(msg.body)
            seen[str(report.kind)] += 1
        else:
            seen[msg.kind] += 1
    return seen


def test_a_live_migration_speaks_only_what_decode_accepts(live: Live) -> None:
    h, ranks = live(ntasks=2)
    h.world.go_silent("c2", at=3.0)
    ranks.fail_collective("c1", at=3.5)

    assert h.run().state == RunState.SUCCEEDED

    seen = decoded_kinds(h)
    assert {Kind.HELLO, Kind.HEARTBEAT, Kind.STANDBY} <= set(seen)
    assert {
        ReportKind.LIVE_READY,
        ReportKind.COLLECTIVE_FAILED,
        ReportKind.GROUP_REBUILT,
        ReportKind.AGREEMENT,
        ReportKind.TRANSFER_DONE,
        ReportKind.FIRST_STEP,
    } <= set(seen)


def test_a_pre_emptive_drain_speaks_only_what_decode_accepts(live: Live) -> None:
    h, _ = live()
    h.world.report("c3", ReportKind.HEALTH_WARNING, at=3.0, status="WARNING", summary="ECC")

    assert h.run().state == RunState.SUCCEEDED

    seen = decoded_kinds(h)
    assert {ReportKind.HEALTH_WARNING, ReportKind.RELEASED, ReportKind.AGREEMENT} <= set(seen)


def test_per_node_heartbeats_carry_typed_task_beats(make: Callable[..., Harness]) -> None:
    h = make(active=2, spares=1, ntasks=3, node_beats=True)

    assert h.run().state == RunState.SUCCEEDED

    decoded_kinds(h)
    relayed = [
        Heartbeat.from_body(s.body)
        for s in h.server.injected
        if s.kind == Kind.HEARTBEAT and "tasks" in s.body
    ]
    assert relayed and all(b.tasks for b in relayed)
    assert {t.local_rank for b in relayed for t in b.tasks or ()} == {1, 2}
    assert all(t.alive is True for b in relayed for t in b.tasks or ())


@pytest.mark.parametrize("event", ["agreement", "no_such_event"])
def test_a_deliberately_malformed_report_is_counted_not_hidden(
    make: Callable[..., Harness], event: str
) -> None:
    """The fake still sends a malformed report a test asks for (the supervisor must drop it),
    and says so, so that the contract above can tell it from drift."""
    h = make(active=2, spares=1)
    h.world.report("c1", event, at=3.0, committed_step="3", epoch=0)

    h.run()

    assert h.world.malformed_sent == 1
