"""The attack suite (issue 11): hostile peers on loopback against the real ControlServer.

The server runs in a process of its own (``attack_server.py``), so that a
libzmq abort, which kills a process without an exception, shows up here as a
dead child. After every attack a legitimate rank (a fresh ControlClient with
the job's secret) connects and round-trips a hello within 1 s, and the
server is still alive. The attackers are raw TCP sockets speaking what they
like, plain zmq sockets (no CURVE), and CURVE clients with another job's
keys; a few cases are a holder of the secret (a buggy rank) who gets through
CURVE and sends malformed messages.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import zmq

from torchpass_slurm.control import messages as m
from torchpass_slurm.control.client import ControlClient
from torchpass_slurm.control.security import derive_keys, make_curve_client
from torchpass_slurm.control.server import ControlServer

SECRET = secrets.token_bytes(32)
HANDSHAKE_MS = 600
MAX_PENDING = 32
ROUND_TRIP = timedelta(seconds=1)
HELLO_BODY = {"node": "n1", "rank": 0, "local_rank": 0, "role": "active", "pid": 1}
SERVER_SCRIPT = Path(__file__).with_name("attack_server.py")


def greeting(mechanism: bytes = b"CURVE", *, as_server: bool = False) -> bytes:
    """A ZMTP 3.0 greeting (64 bytes), as RFC 23 defines it."""
    return (
        b"\xff"
        + b"\0" * 8
        + b"\x7f"
        + b"\x03\x00"
        + mechanism.ljust(20, b"\0")
        + bytes([as_server])
        + b"\0" * 31
    )


@dataclass
class Served:
    proc: subprocess.Popen[str]
    endpoint: str
    port: int
    log: Path
    ranks: int = 0

    def alive(self) -> bool:
        return self.proc.poll() is None

    def round_trip(self) -> dict[str, Any]:
        """A new rank says hello and gets its ack within 1 s; returns the ack's body."""
        self.ranks += 1
        sender = f"rank{self.ranks}/0"
        started = time.monotonic()
        with ControlClient(self.endpoint, SECRET, sender) as client:
            sent = client.send(m.HELLO, HELLO_BODY)
            while (left := ROUND_TRIP.total_seconds() - (time.monotonic() - started)) > 0:
                reply = client.recv(timedelta(seconds=left))
                if reply is not None and reply.kind == m.ACK and reply.body["seq"] == sent.seq:
                    assert reply.to == sender
                    return dict(reply.body)
        raise AssertionError(f"no round trip within {ROUND_TRIP}; server alive: {self.alive()}")

    def check(self) -> dict[str, Any]:
        assert self.alive(), f"the server died (exit {self.proc.returncode})"
        body = self.round_trip()
        assert self.alive()
        return body


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    log = tmp_path_factory.mktemp("attacks") / "server.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(SERVER_SCRIPT), SECRET.hex(), str(HANDSHAKE_MS), str(MAX_PENDING)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    assert proc.stdout is not None
    endpoint = json.loads(proc.stdout.readline())["endpoint"]
    srv = Served(proc, endpoint, int(endpoint.rsplit(":", 1)[1]), log)
    srv.check()
    yield srv
    proc.kill()
    proc.communicate(timeout=10)


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    context.setsockopt(zmq.LINGER, 0)  # also for sockets collected before destroy
    yield context
    context.destroy(linger=0)


def tcp(served: Served) -> socket.socket:
    return socket.create_connection(("127.0.0.1", served.port), timeout=2)


def insider(ctx: zmq.Context, served: Served) -> zmq.Socket:
    """A DEALER with the job's keys: it gets through CURVE (a buggy rank)."""
    sock = ctx.socket(zmq.DEALER)
    make_curve_client(sock, derive_keys(SECRET))
    sock.connect(served.endpoint)
    return sock


def outsider(
    ctx: zmq.Context, served: Served, routing_id: bytes | None = None, *, keys: bool = False
) -> zmq.Socket:
    """A DEALER without the secret: plain ZMTP, or CURVE with another job's keys."""
    sock = ctx.socket(zmq.DEALER)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    if keys:
        make_curve_client(sock, derive_keys(secrets.token_bytes(32)))
    sock.connect(served.endpoint)
    return sock


# --- below the handshake: raw TCP -------------------------------------------------------


def test_garbage_bytes(served: Served) -> None:
    conns = [tcp(served) for _ in range(8)]
    for c in conns:
        c.sendall(os.urandom(4096))
    served.check()
    for c in conns:
        c.close()


def test_truncated_greeting_and_frames(served: Served) -> None:
    cut = [greeting()[:n] for n in (1, 10, 11, 33, 63)] + [greeting() + b"\x04\x05\x05HELL"]
    conns = []
    for data in cut:
        c = tcp(served)
        c.sendall(data)
        conns.append(c)
    served.check()
    for c in conns:
        c.close()


@pytest.mark.parametrize("mechanism", [b"CURVE", b"NULL"])
def test_huge_length_headers(served: Served, mechanism: bytes) -> None:
    """A long frame header claiming 2**63-1 bytes, after a greeting: never allocated."""
    conns = []
    for flags in (0x06, 0x02, 0x00):  # long command, long message, long message (no more)
        c = tcp(served)
        c.sendall(greeting(mechanism) + bytes([flags]) + (2**63 - 1).to_bytes(8, "big") + b"x" * 1024)
        conns.append(c)
    served.check()
    for c in conns:
        c.close()


def test_connection_flood(served: Served) -> None:
    """Far more connections than the handshake budget, held open: the newest survive."""
    before = served.check()
    flood = [tcp(served) for _ in range(MAX_PENDING * 8)]
    try:
        # The gate works through the monitor's events as they come: on a loaded host it may
        # still be behind when the flood is in, so it is given a few seconds to catch up.
        deadline = time.monotonic() + 10
        while True:
            after = served.check()
            shed = after["refused"].get("handshake budget", 0) - before["refused"].get("handshake budget", 0)
            if shed >= MAX_PENDING * 4 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert shed >= MAX_PENDING * 4
    finally:
        for c in flood:
            c.close()


def test_idle_connections_are_closed_at_the_handshake_timeout(served: Served) -> None:
    """Idle peers that sent a greeting (or nothing) hold no descriptor past the handshake timeout."""
    idle = [tcp(served) for _ in range(MAX_PENDING // 2)]
    for c in idle[::2]:
        c.sendall(greeting())
    opened = served.check()["connections"]
    assert opened >= len(idle)
    deadline = time.monotonic() + HANDSHAKE_MS / 1000 + 3
    closed = 0
    while time.monotonic() < deadline and closed < len(idle):
        closed = sum(_closed_by_peer(c) for c in idle)
        time.sleep(0.1)
    assert closed == len(idle)
    assert served.check()["connections"] <= opened - len(idle) + 2
    for c in idle:
        c.close()


def _closed_by_peer(c: socket.socket) -> bool:
    c.setblocking(False)
    try:
        while data := c.recv(4096):  # the server's greeting, then EOF
            del data
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_plain_zmtp_peers_finish_no_handshake(served: Served, ctx: zmq.Context) -> None:
    """zmq DEALERs without CURVE (the NULL mechanism) never reach the ROUTER."""
    peers = [outsider(ctx, served) for _ in range(16)]
    for p in peers:
        p.send_multipart([b"tp3", b"{}", b"\0" * 32])
    body = served.check()
    assert body["rejected"] == {} or all("HMAC" not in c for c in body["rejected"])
    assert any("handshake failed" in cause for cause in body["refused"])


# --- the routing-id attack --------------------------------------------------------------


def _next_ids(served: Served, count: int) -> list[bytes]:
    """The routing ids the ROUTER will give the next peers (its counter is visible in its ids)."""
    last = bytes.fromhex(served.check()["peer"])
    n = int.from_bytes(last[1:], "big")
    return [b"\0" + ((n + k) % 2**32).to_bytes(4, "big") for k in range(1, count + 1)]


@pytest.mark.parametrize("keys", [False, True], ids=["plain", "other-job-keys"])
def test_pre_claimed_routing_ids_do_not_kill_the_server(served: Served, ctx: zmq.Context, keys: bool) -> None:
    claimers = [outsider(ctx, served, rid, keys=keys) for rid in _next_ids(served, 20)]
    for c in claimers:
        c.send(b"hello")
    time.sleep(0.2)  # their handshakes (and refusals) happen now
    for _ in range(3):
        served.check()  # each a new connection: an automatic routing id


def test_the_routing_id_attack_kills_a_plain_router(tmp_path: Path) -> None:
    """The control: the same attack aborts a ROUTER without CURVE, so the test above can see it."""
    script = (
        "import sys, zmq\n"
        "s = zmq.Context().socket(zmq.ROUTER)\n"
        "s.setsockopt(zmq.ROUTER_MANDATORY, 1)\n"
        "print(s.bind_to_random_port('tcp://127.0.0.1'), flush=True)\n"
        "while True:\n"
        "    f = s.recv_multipart(); print(f[0].hex(), flush=True)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)
    try:
        endpoint = f"tcp://127.0.0.1:{int(proc.stdout.readline())}"
        first = ctx.socket(zmq.DEALER)
        first.connect(endpoint)
        first.send(b"x")
        n = int.from_bytes(bytes.fromhex(proc.stdout.readline().strip())[1:], "big")
        claims = []  # kept: a collected socket closes
        for k in range(1, 6):
            claims.append(claim := ctx.socket(zmq.DEALER))
            claim.setsockopt(zmq.ROUTING_ID, b"\0" + (n + k).to_bytes(4, "big"))
            claim.connect(endpoint)
        time.sleep(0.3)
        victim = ctx.socket(zmq.DEALER)
        victim.connect(endpoint)
        victim.send(b"y")
        assert proc.wait(timeout=5) == -6  # SIGABRT: "Assertion failed: ok (src/socket_base.cpp...)"
    finally:
        proc.kill()
        proc.communicate()
        ctx.destroy(linger=0)


# --- wrong keys, replays ----------------------------------------------------------------


def test_a_client_with_another_jobs_secret_gets_nothing_through(served: Served) -> None:
    before = served.check()
    with ControlClient(served.endpoint, secrets.token_bytes(32), "thief/0") as thief:
        thief.send(m.HELLO, HELLO_BODY)
        assert thief.recv(timedelta(milliseconds=300)) is None
    after = served.check()
    assert after["rejected"] == before["rejected"]  # nothing reached decode
    failed = sum(v for c, v in after["refused"].items() if "handshake failed" in c)
    assert failed > sum(v for c, v in before["refused"].items() if "handshake failed" in c)


def test_a_message_addressed_to_another_rank_is_refused() -> None:
    """Bytes the supervisor signed for rank A, delivered to rank B (replay across recipients)."""
    with (
        ControlServer(SECRET, "127.0.0.1") as server,
        ControlClient(server.endpoint, SECRET, "a/0") as a,
        ControlClient(server.endpoint, SECRET, "b/0") as b,
    ):
        a.send(m.HELLO, HELLO_BODY)
        b.send(m.HELLO, HELLO_BODY)
        got: dict[str, bytes] = {}
        while len(got) < 2:
            got.update((msg.sender, peer) for peer, msg in server.poll(timedelta(seconds=2)))
        for_a = m.encode(m.Message(m.STOP, "supervisor", 10**16, time.time(), {"reason": "x"}, "a/0"), SECRET)
        server._sock.send_multipart([got["b/0"], *for_a])
        real = server.send(got["b/0"], m.STOP, {"reason": "y"})
        assert b.recv(timedelta(seconds=2)) == real
        assert b.rejected == 1 and "addressed to" in next(iter(b._receiver.refusals.counts))
        server._sock.send_multipart([got["a/0"], *for_a])
        assert a.recv(timedelta(seconds=2)) is not None  # the same bytes are good for a


# --- a holder of the secret sending malformed messages ---------------------------------------


def _signed(payload: bytes) -> list[bytes]:
    return [m.PROTOCOL_VERSION, payload, m._mac(SECRET, m.PROTOCOL_VERSION, payload)]


def _envelope(body: str, *, ts: str | None = None, kind: str = "report") -> bytes:
    return (
        f'{{"body":{body},"kind":"{kind}","sender":"bug/0","seq":{time.time_ns()},'
        f'"to":"supervisor","ts":{ts or repr(time.time())}}}'
    ).encode()


SIGNED_MALFORMED = {
    "400-digit timestamp": _envelope("{}", ts="9" * 400, kind="bye"),
    "nested 30,000 deep": _envelope('{"event":"live_ready","fields":' + "[" * 30_000 + "]" * 30_000 + "}"),
    "NaN": _envelope('{"event":"live_ready","fields":{"loss":NaN}}'),
    "resumed at step Infinity": _envelope(
        '{"event":"resumed","fields":{"rank":0,"step":Infinity,"epoch":1}}'
    ),
    "resumed at step 1e999": _envelope('{"event":"resumed","fields":{"rank":0,"step":1e999,"epoch":1}}'),
}


def test_signed_but_malformed_messages(served: Served, ctx: zmq.Context) -> None:
    before = served.check()["rejected"]
    bug = insider(ctx, served)
    for payload in SIGNED_MALFORMED.values():
        bug.send_multipart(_signed(payload))
    for frames in ([b"tp3"], [b"tp3", b"{}"], [b"tp3", b"{", b"\0" * 32, b"more"]):  # truncated, extra
        bug.send_multipart(frames)
    time.sleep(0.2)
    after = served.check()["rejected"]
    assert sum(after.values()) - sum(before.values()) == len(SIGNED_MALFORMED) + 3


def test_the_log_keeps_each_cause_apart(caplog: pytest.LogCaptureFixture) -> None:
    """Junk of one cause past the log's budget does not hide a later refusal of another cause."""
    receiver = m.Receiver(SECRET, m.WORKER_KINDS, recipient=m.SUPERVISOR)
    with caplog.at_level(logging.WARNING, logger="torchpass_slurm.control.messages"):
        for _ in range(receiver.refusals.LOG_FIRST + 30):
            receiver.accept([b"junk"], "peer 01")
        receiver.accept(_signed(_envelope("{}", ts="1.0", kind="bye")), "peer 02")
    assert receiver.rejected == receiver.refusals.LOG_FIRST + 31
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == receiver.refusals.LOG_FIRST + 1
    assert "window" in lines[-1] and "peer 02" in lines[-1]


def test_the_server_logged_its_refusals(served: Served) -> None:
    """Runs last in this module: every attack above left a line in the server's log."""
    served.check()
    text = served.log.read_text()
    assert "refused a control-plane connection" in text and "shed the oldest" in text
    assert "dropped control message" in text and "nested deeper" in text
