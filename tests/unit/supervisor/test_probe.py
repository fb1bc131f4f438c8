"""The slurmd probe on real sockets, on loopback only: answers, refusals, silence, bad names."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from torchpass_slurm.config import SupervisorConfig
from torchpass_slurm.errors import ConfigError
from torchpass_slurm.supervisor.probe import NodeProbe, ProbeResult


def wait_verdict(probe: NodeProbe, node: str, since: float = 0.0, timeout: float = 5.0) -> ProbeResult:
    deadline = time.monotonic() + timeout
    while (result := probe.verdict(node, since)) is None:
        assert time.monotonic() < deadline, f"no verdict on {node} within {timeout} s"
        time.sleep(0.01)
    return result


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield sock
    sock.close()


def test_a_listening_port_is_reachable(listener: socket.socket) -> None:
    probe = NodeProbe(["127.0.0.1"], port=listener.getsockname()[1], timeout=1.0)
    probe.start("127.0.0.1")
    result = wait_verdict(probe, "127.0.0.1")
    assert result.reachable and "accepts" in result.detail
    probe.close()


def test_only_a_listening_slurmd_says_the_node_may_serve_again(listener: socket.socket) -> None:
    """``probe_now`` (the spare pool's, on its own thread): a refused connection is a host that
    answers, not a slurmd that runs; only an accepted one lets a lost node back before Slurm's
    SlurmdTimeout has passed."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening
    probes = [NodeProbe([], port=s.getsockname()[1], timeout=1.0) for s in (listener, closed)]
    up, refused = (p.probe_now("127.0.0.1") for p in probes)
    for p in probes:
        p.close()
    closed.close()
    assert up.reachable and up.slurmd
    assert refused.reachable and not refused.slurmd


def test_a_refused_connection_is_a_host_that_answers() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound, never listening: the kernel refuses
    port = sock.getsockname()[1]
    probe = NodeProbe([], port=port, timeout=1.0)
    probe.start("127.0.0.1")
    assert wait_verdict(probe, "127.0.0.1").reachable
    probe.close()
    sock.close()


def test_a_port_that_never_answers_is_unreachable_after_the_timeout() -> None:
    """A full accept queue drops further SYNs, as a node that is powered off answers none."""
    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    port = full.getsockname()[1]
    fillers = []
    for _ in range(4):  # fill the queue (never accepted); later connects hang
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        fillers.append(s)
    time.sleep(0.1)
    probe = NodeProbe([], port=port, timeout=0.3)
    started = time.monotonic()
    probe.start("127.0.0.1")
    result = wait_verdict(probe, "127.0.0.1")
    assert not result.reachable and "did not answer within 0.3 s" in result.detail
    assert 0.25 <= time.monotonic() - started < 3.0
    probe.close()
    for s in fillers:
        s.close()
    full.close()


def test_a_name_that_does_not_resolve_is_no_evidence() -> None:
    probe = NodeProbe([], port=6818, timeout=0.3)
    probe.start("no-such-node.invalid")
    result = wait_verdict(probe, "no-such-node.invalid")
    assert result.reachable and "cannot resolve" in result.detail
    probe.close()


def test_an_old_verdict_does_not_answer_for_a_newer_silence(listener: socket.socket) -> None:
    probe = NodeProbe([], port=listener.getsockname()[1], timeout=1.0)
    probe.start("127.0.0.1")
    first = wait_verdict(probe, "127.0.0.1")
    assert probe.verdict("127.0.0.1", since=first.started + 1.0) is None
    probe.close()


def test_addresses_of_the_job_nodes_map_back_to_their_names() -> None:
    probe = NodeProbe(["localhost"], timeout=0.3)
    deadline = time.monotonic() + 5
    while probe.node_of_address("127.0.0.1") is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert probe.node_of_address("127.0.0.1") == "localhost"
    assert probe.node_of_address("localhost") == "localhost"
    assert probe.node_of_address("10.9.9.9") is None
    probe.close()


def test_settings_come_from_the_environment_with_clear_errors() -> None:
    config = SupervisorConfig.from_env(
        {"TORCHPASS_HEARTBEAT_INTERVAL": "0.5", "TORCHPASS_PROBE_PORT": "7000"}
    )
    assert (config.heartbeat_interval, config.probe_port) == (0.5, 7000)
    assert SupervisorConfig.from_env({}) == SupervisorConfig()
    with pytest.raises(ConfigError, match="TORCHPASS_PROBE_PORT='x' is not an integer"):
        SupervisorConfig.from_env({"TORCHPASS_PROBE_PORT": "x"})
    with pytest.raises(ConfigError, match="TORCHPASS_SILENCE_THRESHOLD='-1' must be above 0"):
        SupervisorConfig.from_env({"TORCHPASS_SILENCE_THRESHOLD": "-1"})
