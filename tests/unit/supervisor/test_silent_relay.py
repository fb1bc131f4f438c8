"""Per-node heartbeats: a node whose local rank 0 falls silent is judged as a node, never as
one of its ranks (their entries stopped with it; they are not hung "while their node beats")."""

from __future__ import annotations

from torchpass_slurm.rundir import events as ev

from .conftest import CONFIG, Live, at_of
from .test_detection import PASS
from .test_node_heartbeats import one_fault


def test_a_silent_relay_loses_its_node_at_the_heartbeat_timeout_not_a_rank_behind_it(live: Live) -> None:
    """c2/1's entry stops half a second before its relay does (a rank quiet, then the node's
    agent gone): what the supervisor last heard of c2/1 is older than the relay's last beat,
    but its node no longer beats, so it is not the hung one. The node still answers its probe:
    only the timeout confirms, from the relay's last beat."""
    h, _ = live(probe=True, ntasks=2, node_beats=True)
    h.world.go_quiet("c2/1", at=2.5)
    h.world.go_quiet("c2/0", at=3.0)

    h.run()

    fault = one_fault(h)
    assert (fault.kind, fault.fields["node"], fault.fields["evidence"]) == (
        ev.HEARTBEAT_LOST,
        "c2",
        "timeout",
    )
    assert "no heartbeat from c2" in fault.fields["detail"]
    assert (
        3.0 + CONFIG.heartbeat_timeout - PASS <= at_of(h, fault) <= 3.0 + CONFIG.heartbeat_timeout + 2 * PASS
    )
