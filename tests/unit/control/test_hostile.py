"""Signed but malformed messages, as a holder of the secret (or a buggy rank) could send them.

Each is refused with a ControlPlaneError, by ``decode`` and by the real
ControlServer on loopback, which goes on serving a legitimate rank. The MAC
is computed from the protocol's definition (docs/protocol.md, "The MAC"), not
by the code under test.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import zmq

from torchpass_slurm.control import messages as m
from torchpass_slurm.control.bodies import Report
from torchpass_slurm.control.client import ControlClient
from torchpass_slurm.control.security import derive_keys, make_curve_client
from torchpass_slurm.control.server import ControlServer
from torchpass_slurm.errors import ControlPlaneError
from torchpass_slurm.rundir import events as ev

SECRET = b"h" * 32
WAIT = timedelta(seconds=5)
NOW = 1_800_000_000.0
BEAT = {"rank": 0, "step": 1, "state": "training"}


def frames(payload: bytes) -> list[bytes]:
    """A message signed as the protocol says: HMAC-SHA256(secret, DOMAIN + version + NUL + payload)."""
    mac = hmac.new(SECRET, b"torchpass-slurm control plane\0" + b"tp3\0" + payload, hashlib.sha256)
    return [b"tp3", payload, mac.digest()]


def envelope(body: str = "{}", *, kind: str = "heartbeat", ts: str = str(NOW), seq: str = "1") -> bytes:
    head = f'"kind":"{kind}","sender":"n1/0","seq":{seq},"to":"supervisor"'
    return f'{{"body":{body},{head},"ts":{ts}}}'.encode()


def nested(depth: int) -> str:
    return '{"a":' * depth + "0" + "}" * depth


def report(fields: str) -> bytes:
    """A report: its fields are free-form JSON, so no body schema stands in the way."""
    return envelope(kind="report", body=f'{{"event":"live_ready","fields":{fields}}}')


def node_beat(tasks: str) -> bytes:
    """A per-node heartbeat: local rank 0's own beat and ``tasks``, its node's other ranks."""
    return envelope(body='{"rank":0,"step":1,"state":"sync","tasks":' + tasks + "}")


TASK = '[1,1,7,"sync",120]'

HOSTILE: dict[str, bytes] = {
    "400-digit timestamp": envelope(ts="9" * 400),
    "400-digit seq": envelope(seq="9" * 400),
    "400-digit field": report('{"rank":0,"step":' + "9" * 400 + "}"),
    "nested 10,000 deep (within the frame limit)": report(nested(10_000)),
    "nested 40 deep": report(nested(40)),
    "NaN": report('{"rank":0,"loss":NaN}'),
    "Infinity": report('{"rank":0,"step":Infinity}'),
    "-Infinity timestamp": envelope(ts="-Infinity"),
    "1e400": report('{"rank":0,"step":1e400}'),
    "resumed at step Infinity": envelope(
        kind="report", body='{"event":"resumed","fields":{"rank":0,"step":Infinity,"epoch":1}}'
    ),
    "tasks: an object": node_beat('{"1":[1,1,7,"sync",120]}'),
    "tasks: null": node_beat("null"),
    "tasks: 1,025 entries": node_beat("[" + ",".join([TASK] * 1025) + "]"),
    "task of 4 fields": node_beat('[[1,1,7,"sync"]]'),
    "task of 6 fields": node_beat('[[1,1,7,"sync",120,0]]'),
    "task: an object": node_beat('[{"local_rank":1}]'),
    "task: negative local rank": node_beat('[[-1,1,7,"sync",120]]'),
    "task: local rank true": node_beat('[[true,1,7,"sync",120]]'),
    "task: local rank 1.0": node_beat('[[1.0,1,7,"sync",120]]'),
    "task: rank a string": node_beat('[[1,"1",7,"sync",120]]'),
    "task: step false": node_beat('[[1,1,false,"sync",120]]'),
    "task: state 65 characters": node_beat('[[1,1,7,"' + "s" * 65 + '",120]]'),
    "task: state null": node_beat("[[1,1,7,null,120]]"),
    "task: negative age": node_beat('[[1,1,7,"sync",-1]]'),
    "task: age 0.5": node_beat('[[1,1,7,"sync",0.5]]'),
    "task: age null": node_beat('[[1,1,7,"sync",null]]'),
    "one good task, then a bad one": node_beat(f'[{TASK},[2,2,7,"sync","old"]]'),
}


@pytest.mark.parametrize("payload", HOSTILE.values(), ids=HOSTILE.keys())
def test_decode_refuses_it_with_a_control_plane_error(payload: bytes) -> None:
    with pytest.raises(ControlPlaneError):
        m.decode(frames(payload), SECRET, now=NOW)


def test_a_well_formed_message_of_the_same_shape_is_accepted() -> None:
    """The control: the hand-signed envelope itself is valid, so only the hostile part is refused."""
    msg = m.decode(frames(envelope(body='{"rank":0,"step":1,"state":"x"}')), SECRET, now=NOW)
    assert (msg.kind, msg.body["step"]) == ("heartbeat", 1)


def test_a_node_beat_at_the_bounds_is_accepted() -> None:
    """The control of the ``tasks`` cases: 1,024 entries, a 64-character state, nulls, age 0."""
    most = node_beat("[" + ",".join([TASK] * m.MAX_TASKS) + "]")
    assert len(m.decode(frames(most), SECRET, now=NOW).body["tasks"]) == 1024
    edge = node_beat('[[0,null,null,"' + "s" * 64 + '",0],[3,9,null,"",9000000000]]')
    assert m.decode(frames(edge), SECRET, now=NOW).body["tasks"][1] == [3, 9, None, "", 9_000_000_000]
    assert m.decode(frames(node_beat("[]")), SECRET, now=NOW).body["tasks"] == []


def test_encode_refuses_a_malformed_node_beat_too() -> None:
    """A rank's own bug is caught before it is sent, by the same check."""
    body = {"rank": 0, "step": 1, "state": "sync", "tasks": [[1, 1, 7, "sync", -5]]}
    with pytest.raises(ControlPlaneError, match="task entry"):
        m.encode(m.Message(m.HEARTBEAT, "n1/0", 1, NOW, body), SECRET)


def test_nesting_up_to_the_bound_parses() -> None:
    """The envelope, the body and the fields object are the first three levels."""
    msg = m.decode(frames(report(nested(m.MAX_NESTING - 2))), SECRET, now=NOW)  # deepest: level 16
    assert msg.kind == "report"
    with pytest.raises(ControlPlaneError, match="nested deeper"):
        m.decode(frames(report(nested(m.MAX_NESTING - 1))), SECRET, now=NOW)


@pytest.mark.parametrize(
    ("event", "fields"),
    [
        ("resumed", {"rank": 0, "step": 3, "epoch": "1"}),
        ("agreement", {"rank": 0, "committed_step": "7", "epoch": 1}),
        ("first_step", {"rank": 0, "epoch": 1}),
        ("no_such_event", {"rank": 0}),
        (
            "agreement",
            {"rank": 0, "committed_step": 7, "epoch": 1, "node": "n9"},
        ),  # node: set by the supervisor
        ("group_rebuilt", {"rank": 0, "epoch": 1, "seconds": "fast"}),
        ("live_ready", {"rank": "0"}),
        ("collective_failed", {"rank": 0, "epoch": 1, "error": ["x"]}),
        ("health_warning", {"rank": 0, "node": "n1", "status": 2, "summary": ""}),
    ],
)
def test_a_report_with_a_mistyped_or_missing_field_is_refused(event: str, fields: dict[str, Any]) -> None:
    with pytest.raises(ControlPlaneError):
        Report.from_body({"event": event, "fields": fields})


def test_the_event_log_refuses_an_epoch_that_is_not_an_integer(tmp_path: Path) -> None:
    with ev.EventLog(tmp_path / "events.jsonl", job="7") as log:
        with pytest.raises(ev.EventLogError, match="epoch"):
            log.append("agreement", epoch="1")  # type: ignore[arg-type]
        log.append("agreement", epoch=2, committed_step=3)
    (event,) = ev.read_events(tmp_path / "events.jsonl")
    assert (event.epoch, event.fields) == (2, {"committed_step": 3})


@pytest.fixture
def server() -> Iterator[ControlServer]:
    with ControlServer(SECRET, "127.0.0.1") as srv:
        yield srv


@pytest.fixture
def raw(server: ControlServer) -> Iterator[Callable[[list[bytes]], None]]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    make_curve_client(sock, derive_keys(SECRET))  # a holder of the secret: it gets through CURVE
    sock.connect(server.endpoint)
    yield sock.send_multipart
    sock.close()
    ctx.term()


def test_the_real_server_drops_every_case_and_goes_on_serving(
    server: ControlServer, raw: Callable[[list[bytes]], None]
) -> None:
    import time

    now = str(time.time())
    for payload in HOSTILE.values():
        raw(frames(payload.replace(str(NOW).encode(), now.encode())))
    with ControlClient(server.endpoint, SECRET, "n2/0") as client:
        sent = client.send(m.HEARTBEAT, BEAT)
        got: list[m.Message] = []
        deadline = time.monotonic() + WAIT.total_seconds()
        while (not got or server.rejected < len(HOSTILE)) and time.monotonic() < deadline:
            got += [msg for _, msg in server.poll(timedelta(milliseconds=200))]
    assert got == [sent]
    assert server.rejected == len(HOSTILE)
