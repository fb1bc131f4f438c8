"""scripts/devcluster.py: a cluster that cannot come up says why, at once.

The judging is pure (parse_node_states, stopped_nodes, log_excerpt,
not_up_message); Cluster.wait_idle is driven here by a fake that answers what
docker and sinfo would, so no Docker is needed.
"""

from __future__ import annotations

import time

import pytest

from scripts import devcluster as dc
from scripts.devcluster import Cluster, ClusterError

#: What slurmd 24.11 printed when it found a SPANK plugin built against Slurm 22.05.
SLURMD_REFUSES_PLUGIN = """\
slurmd: slurmd version 24.11.5 started
slurmd: error: spank: /usr/lib/x86_64-linux-gnu/slurm-wlm/torchpass.so: Incompatible plugin version
slurmd: error: spank: /etc/slurm/plugstack.conf:3: Failed to load plugin /usr/lib/x86_64-linux-gnu/slurm-wlm/torchpass.so. Aborting.
slurmd: error: slurmd initialization failed
"""  # noqa: E501 (slurmd's log, verbatim)


def test_sinfo_lines_become_lower_case_states() -> None:
    assert dc.parse_node_states("c1 IDLE\nc2 down*\n\nnoise\n") == {"c1": "idle", "c2": "down*"}


def test_a_node_whose_container_is_not_running_is_stopped() -> None:
    containers = {"ctl": "running", "c1": "running", "c2": "exited", "c4": "dead"}
    assert dc.stopped_nodes(("ctl", "c1", "c2", "c3", "c4"), containers) == ["c2", "c3", "c4"]


def test_the_excerpt_is_the_error_lines_of_the_log() -> None:
    assert dc.log_excerpt(SLURMD_REFUSES_PLUGIN, lines=2) == [
        (
            "slurmd: error: spank: /etc/slurm/plugstack.conf:3: Failed to load plugin "
            "/usr/lib/x86_64-linux-gnu/slurm-wlm/torchpass.so. Aborting."
        ),
        "slurmd: error: slurmd initialization failed",
    ]


def test_without_errors_the_excerpt_is_the_last_lines() -> None:
    log = "".join(f"line {i}\n" for i in range(10))
    assert dc.log_excerpt(log, lines=2) == ["line 8", "line 9"]
    assert dc.log_excerpt("") == []


def test_the_message_names_the_stopped_nodes_and_quotes_their_logs_once() -> None:
    logs = {"c1": SLURMD_REFUSES_PLUGIN, "c2": SLURMD_REFUSES_PLUGIN, "c3": ""}
    message = dc.not_up_message({n: "unknown*" for n in logs}, list(logs), logs, 2.4)
    lines = message.splitlines()
    assert lines[0] == "c1, c2, c3 stopped 2 s after the start (container not running)"
    assert lines[1] == "  c1, c2 say:"
    assert lines[2].endswith("torchpass.so: Incompatible plugin version")
    assert lines[4:6] == ["    slurmd: error: slurmd initialization failed", "  c3 says:"]
    assert lines[6] == "    (empty log)"
    assert lines[-1].startswith("More: `scripts/cluster logs NODE`")


def test_the_timeout_message_names_the_nodes_that_are_not_idle() -> None:
    message = dc.not_up_message({"c3": "down*", "c1": "unknown"}, [], {}, 240.2)
    assert message.splitlines()[0] == "nodes not idle after 240 s: c1=unknown, c3=down*"


class FakeCluster(Cluster):
    """What docker and sinfo show: c1..c4 idle, c5's container exited with the log above."""

    def __init__(self, containers: dict[str, str], states: dict[str, str]) -> None:
        super().__init__()
        self._containers, self._states, self.resumed = containers, states, []

    def containers(self) -> dict[str, str]:
        return dict(self._containers)

    def _states_or_none(self) -> dict[str, str]:
        return dict(self._states)

    def daemon_log(self, node: str, lines: int = 200) -> str:
        return SLURMD_REFUSES_PLUGIN if node == "c5" else f"{node}: fine\n"


def test_wait_idle_fails_at_once_when_a_node_container_exited() -> None:
    running = {n: "running" for n in dc.NODES}
    fake = FakeCluster({**running, "c5": "exited"}, {**{n: "idle" for n in dc.COMPUTE}, "c5": "unknown*"})
    began = time.monotonic()
    with pytest.raises(ClusterError) as err:
        fake.wait_idle(timeout=240)
    assert time.monotonic() - began < 1.0  # not the 240 s timeout
    assert str(err.value).startswith("c5 stopped 0 s after the start")
    assert "  c5 says:" in str(err.value) and "Incompatible plugin version" in str(err.value)


def test_wait_idle_returns_when_every_node_is_idle() -> None:
    fake = FakeCluster({n: "running" for n in dc.NODES}, {n: "idle" for n in dc.COMPUTE + dc.SERVICE})
    fake.wait_idle(timeout=1)


def test_wait_idle_waits_for_the_service_node_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dc, "POLL_S", 0.01)
    fake = FakeCluster({n: "running" for n in dc.NODES}, {**{n: "idle" for n in dc.COMPUTE}, "s1": "unknown"})
    with pytest.raises(ClusterError, match="nodes not idle after 0 s: s1=unknown"):
        fake.wait_idle(timeout=0.05)


def test_a_cluster_started_without_a_service_node_is_idle_with_c1_to_c5() -> None:
    """A cluster brought up from a compose file older than s1 (another engineer's, say)."""
    fake = FakeCluster({n: "running" for n in (dc.CONTROLLER, *dc.COMPUTE)}, {n: "idle" for n in dc.COMPUTE})
    fake.wait_idle(timeout=1)


def test_on_timeout_the_controller_and_the_waiting_nodes_are_quoted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dc, "POLL_S", 0.01)
    fake = FakeCluster({n: "running" for n in dc.NODES}, {**{n: "idle" for n in dc.COMPUTE}, "c2": "unknown"})
    with pytest.raises(ClusterError) as err:
        fake.wait_idle(timeout=0.05)
    text = str(err.value)
    assert text.startswith("nodes not idle after 0 s: c2=unknown")
    assert "  c2 says:\n    c2: fine" in text and "  ctl says:\n    ctl: fine" in text
