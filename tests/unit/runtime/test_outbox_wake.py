"""The heartbeat thread sleeps between heartbeats in one poll that the outbox wakes: a report
the training thread queues leaves at once, not at the next heartbeat, and a close ends the
thread at once. Real ControlClient and ControlServer on 127.0.0.1."""

from __future__ import annotations

import datetime
import logging
import select
import time
from pathlib import Path

import pytest

pytest.importorskip("zmq")

from torchpass_slurm.control.client import ControlClient
from torchpass_slurm.control.secret import create_secret, load_secret
from torchpass_slurm.control.server import ControlServer
from torchpass_slurm.rank.link import Heartbeat, Outbox

#: Far longer than any wait below: a message that waited for the next heartbeat would miss them.
INTERVAL_S = 60.0


def readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def test_an_outbox_put_makes_its_pipe_readable_until_cleared() -> None:
    box = Outbox()
    try:
        assert not readable(box.fileno())
        box.put(("report", {"event": "x"}))
        assert readable(box.fileno())
        box.clear_wakeups()
        assert not readable(box.fileno())
        assert box.get_nowait() == ("report", {"event": "x"})
    finally:
        box.close()


def test_a_queued_report_leaves_before_the_next_heartbeat_and_close_is_prompt(tmp_path: Path) -> None:
    secret = load_secret(create_secret(tmp_path))
    with ControlServer(secret, "127.0.0.1") as server:
        client = ControlClient(server.endpoint, secret, "c1/0")
        box = Outbox()
        hb = Heartbeat(
            client,
            INTERVAL_S,
            beat=lambda state=None: {"rank": 0, "step": 1, "state": "running"},
            on_message=lambda msg: None,
            outbox=box,
            log=logging.LoggerAdapter(logging.getLogger("test"), {}),
        )
        hb.start()
        try:
            kinds: list[str] = []
            deadline = time.monotonic() + 10
            while "heartbeat" not in kinds and time.monotonic() < deadline:  # the first, at once
                kinds += [m.kind for _, m in server.poll(datetime.timedelta(milliseconds=100))]
            box.put(("report", {"event": "resumed", "fields": {"step": 1}}))
            sent = time.monotonic()
            got = []
            while not got and time.monotonic() - sent < 5:
                got = [m for _, m in server.poll(datetime.timedelta(milliseconds=100)) if m.kind == "report"]
            assert got, "the report waited for the next heartbeat"
            stopping = time.monotonic()
            hb.stop()
            hb.join(5)
            assert not hb.is_alive() and time.monotonic() - stopping < 5
        finally:
            hb.stop()
            hb.join(5)
            box.close()
