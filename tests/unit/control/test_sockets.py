"""ControlServer and ControlClient over real ZeroMQ sockets on 127.0.0.1."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import zmq

from torchpass_slurm.control import messages as m
from torchpass_slurm.control.client import ControlClient
from torchpass_slurm.control.security import derive_keys, make_curve_client
from torchpass_slurm.control.server import SUPERVISOR_SENDER, ControlServer
from torchpass_slurm.errors import ControlPlaneError

SECRET = b"s" * 32
WAIT = timedelta(seconds=5)
SHORT = timedelta(milliseconds=200)
HELLO_BODY = {"node": "n1", "rank": 0, "local_rank": 0, "role": "active", "pid": 42}
BEAT = {"rank": 0, "step": 1, "state": "training"}


@pytest.fixture
def server() -> Iterator[ControlServer]:
    with ControlServer(SECRET, "127.0.0.1") as srv:
        yield srv


@pytest.fixture
def client(server: ControlServer) -> Iterator[ControlClient]:
    with ControlClient(server.endpoint, SECRET, "n1/0") as c:
        yield c


@pytest.fixture
def raw(server: ControlServer) -> Iterator[zmq.Socket]:
    """A bare DEALER that sends whatever frames a test wants."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    make_curve_client(sock, derive_keys(SECRET))  # a holder of the secret: it gets through CURVE
    sock.connect(server.endpoint)
    yield sock
    sock.close()
    ctx.term()


def poll_one(server: ControlServer) -> tuple[bytes, m.Message]:
    got = server.poll(WAIT)
    assert len(got) == 1, got
    return got[0]


def assert_still_serving(server: ControlServer, client: ControlClient) -> None:
    sent = client.send(m.HEARTBEAT, BEAT)
    assert poll_one(server)[1] == sent


def test_endpoint_names_the_bound_port(server: ControlServer) -> None:
    assert server.endpoint == f"tcp://127.0.0.1:{server.port}" and server.port > 0


def test_advertise_host_is_what_workers_see() -> None:
    with ControlServer(SECRET, "127.0.0.1", advertise_host="batch-host") as srv:
        assert srv.endpoint == f"tcp://batch-host:{srv.port}"


def test_round_trip_both_ways(server: ControlServer, client: ControlClient) -> None:
    sent = client.send(m.HELLO, HELLO_BODY)
    peer, got = poll_one(server)
    assert got == sent and server.peer_of("n1/0") == peer
    promote = {
        "rank": 4,
        "local_rank": 0,
        "world_size": 8,
        "master_addr": "n1",
        "master_port": 29500,
        "epoch": 1,
    }
    reply = server.send(peer, m.PROMOTE, promote)
    back = client.recv(WAIT)
    assert back == reply and back.sender == SUPERVISOR_SENDER and back.body == promote


def test_poll_returns_everything_queued(server: ControlServer, client: ControlClient) -> None:
    sent = [client.send(m.HEARTBEAT, {**BEAT, "step": i}) for i in range(50)]
    got: list[m.Message] = []
    while len(got) < len(sent):
        batch = server.poll(WAIT)
        assert batch
        got += [msg for _, msg in batch]
    assert got == sent


def test_timeouts_return_empty(server: ControlServer, client: ControlClient) -> None:
    assert server.poll(SHORT) == []
    assert client.recv(SHORT) is None
    assert client.recv(timedelta(0)) is None


def test_forged_message_is_dropped_and_server_keeps_serving(
    server: ControlServer, client: ControlClient, raw: zmq.Socket, caplog: pytest.LogCaptureFixture
) -> None:
    forged = m.encode(m.Message(m.HELLO, "n1/0", 10**18, time.time(), HELLO_BODY), b"x" * 32)
    with caplog.at_level(logging.WARNING, logger="torchpass_slurm.control.messages"):
        raw.send_multipart(forged)
        assert server.poll(SHORT) == []
    assert server.rejected == 1
    assert "HMAC" in caplog.text and SECRET.hex() not in caplog.text
    assert server.peer_of("n1/0") is None
    assert_still_serving(server, client)


def test_replayed_message_is_dropped(server: ControlServer, client: ControlClient, raw: zmq.Socket) -> None:
    frames = m.encode(m.Message(m.HEARTBEAT, "n2/0", 1, time.time(), BEAT), SECRET)
    raw.send_multipart(frames)
    assert len(server.poll(WAIT)) == 1
    raw.send_multipart(frames)
    assert server.poll(SHORT) == [] and server.rejected == 1
    assert_still_serving(server, client)


def test_stale_message_is_dropped(server: ControlServer, client: ControlClient) -> None:
    with ControlClient(server.endpoint, SECRET, "late/0", clock=lambda: time.time() - 3600) as late:
        late.send(m.HEARTBEAT, BEAT)
        assert server.poll(SHORT) == [] and server.rejected == 1
    assert_still_serving(server, client)


@pytest.mark.parametrize(
    "frames",
    [
        [b""],
        [b"tp1", b"{}", b"\0" * 32],
        [b"garbage"] * 7,
        m.encode(m.Message(m.STOP, "supervisor", 1, time.time(), {"reason": "x"}), SECRET),
    ],
    ids=["empty", "bad-mac", "seven-frames", "reflected-supervisor-kind"],
)
def test_malformed_frames_are_dropped(
    server: ControlServer, client: ControlClient, raw: zmq.Socket, frames: list[bytes]
) -> None:
    raw.send_multipart(frames)
    assert server.poll(SHORT) == [] and server.rejected == 1
    assert_still_serving(server, client)


def test_oversized_frame_never_reaches_decode(
    server: ControlServer, client: ControlClient, raw: zmq.Socket
) -> None:
    raw.send_multipart([b"tp1", b"x" * (m.MAX_FRAME_BYTES + 4096), b"\0" * 32])
    assert server.poll(SHORT) == []
    assert server.rejected == 0  # ZeroMQ cut the peer off (MAXMSGSIZE) before decode saw it
    assert_still_serving(server, client)


def test_client_drops_forgeries_and_keeps_waiting(server: ControlServer, client: ControlClient) -> None:
    client.send(m.HELLO, HELLO_BODY)
    peer, _ = poll_one(server)
    forged = m.encode(m.Message(m.STOP, SUPERVISOR_SENDER, 10**18, time.time(), {"reason": "x"}), b"x" * 32)
    server._sock.send_multipart([peer, *forged])
    real = server.send(peer, m.STOP, {"reason": "done"})
    assert client.recv(WAIT) == real and client.rejected == 1


def test_send_to_unknown_peer_is_a_clear_error(server: ControlServer) -> None:
    with pytest.raises(ControlPlaneError, match="not connected"):
        server.send(b"\0nobody", m.STOP, {"reason": "x"})


def test_send_refuses_invalid_body(client: ControlClient) -> None:
    with pytest.raises(ControlPlaneError, match="lacks the field"):
        client.send(m.HELLO, {"node": "n1"})


def test_client_is_usable_from_two_threads(server: ControlServer, client: ControlClient) -> None:
    """A heartbeat thread sends while the main thread waits in recv."""
    client.send(m.HELLO, HELLO_BODY)
    _peer, _ = poll_one(server)
    beats = threading.Thread(target=lambda: [client.send(m.HEARTBEAT, BEAT) for _ in range(20)])
    beats.start()
    assert client.recv(timedelta(milliseconds=300)) is None
    beats.join(timeout=5)
    got: list[m.Message] = []
    while len(got) < 20:
        got += [msg for _, msg in server.poll(WAIT)]
    assert len(got) == 20


def test_bad_endpoint_is_a_control_plane_error() -> None:
    with pytest.raises(ControlPlaneError, match="tcp://HOST:PORT"):
        ControlClient("nonsense", SECRET, "n1/0")


def test_port_in_use_is_a_control_plane_error(server: ControlServer) -> None:
    with pytest.raises(ControlPlaneError, match="cannot bind"):
        ControlServer(SECRET, "127.0.0.1", server.port)


def test_a_port_in_use_names_which_server_and_leaves_no_gate_running(server: ControlServer) -> None:
    """Both servers open their socket through one GuardedRouter: a failed bind closes its gate's
    thread and its context, and says which server could not bind where."""
    import threading

    from torchpass_slurm.control.store_server import StoreServer

    before = {t.name for t in threading.enumerate()}
    with pytest.raises(
        ControlPlaneError, match=rf"cannot bind the job's store to tcp://127.0.0.1:{server.port}"
    ):
        StoreServer(SECRET, "127.0.0.1", server.port)
    with pytest.raises(
        ControlPlaneError, match=rf"cannot bind the control plane to tcp://127.0.0.1:{server.port}"
    ):
        ControlServer(SECRET, "127.0.0.1", server.port)
    assert {t.name for t in threading.enumerate()} <= before
