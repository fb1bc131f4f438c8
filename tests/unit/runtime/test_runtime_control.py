"""The runtime against the real control plane (ZeroMQ on 127.0.0.1, real secret file)."""

from __future__ import annotations

import datetime
import threading
from pathlib import Path

import pytest

pytest.importorskip("zmq")

from torchpass_slurm.config import SupervisorConfig
from torchpass_slurm.control.messages import Message
from torchpass_slurm.control.secret import create_secret, load_secret
from torchpass_slurm.control.server import ControlServer
from torchpass_slurm.rank import runtime

FAST = SupervisorConfig(heartbeat_interval=0.05)
WAIT = datetime.timedelta(seconds=5)


def next_message(server: ControlServer, kind: str) -> tuple[bytes, Message]:
    """The next message of ``kind`` (others, e.g. heartbeats, are skipped)."""
    deadline = datetime.datetime.now() + WAIT
    while datetime.datetime.now() < deadline:
        for peer, msg in server.poll(datetime.timedelta(milliseconds=100)):
            if msg.kind == kind:
                return peer, msg
    raise AssertionError(f"no {kind!r} message within {WAIT}")


def test_spare_promoted_over_the_real_control_plane(tmp_path: Path) -> None:
    secret_file = create_secret(tmp_path)
    with ControlServer(load_secret(secret_file), "127.0.0.1") as server:
        env = {
            "TORCHPASS_CONTROL": server.endpoint,
            "TORCHPASS_SECRET_FILE": str(secret_file),
            "TORCHPASS_ROLE": "spare",
            "TORCHPASS_NODE": "c4",
            "TORCHPASS_JOB_ID": "7",
            "SLURM_LOCALID": "0",
        }
        started: list[runtime.Runtime] = []
        t = threading.Thread(target=lambda: started.append(runtime.init(env, config=FAST)))
        t.start()
        peer, standby = next_message(server, "standby")
        assert standby.sender == "c4/0" and standby.body["node"] == "c4"
        server.send(
            peer,
            "promote",
            {
                "rank": 1,
                "local_rank": 0,
                "world_size": 3,
                "master_addr": "c1",
                "master_port": 29500,
                "epoch": 2,
            },
        )
        _, hello = next_message(server, "hello")
        t.join(5)
        rt = started[0]
        assert hello.body["rank"] == 1 and hello.body["promoted"] is True
        rt.report_step(11)
        _, beat = next_message(server, "heartbeat")
        while beat.body["step"] != 11:
            _, beat = next_message(server, "heartbeat")
        rt.close()
        _, bye = next_message(server, "bye")
        assert bye.body["state"] == "done"


def test_spare_stopped_over_the_real_control_plane(tmp_path: Path) -> None:
    secret_file = create_secret(tmp_path)
    with ControlServer(load_secret(secret_file), "127.0.0.1") as server:
        env = {
            "TORCHPASS_CONTROL": server.endpoint,
            "TORCHPASS_SECRET_FILE": str(secret_file),
            "TORCHPASS_ROLE": "spare",
            "TORCHPASS_NODE": "c5",
        }
        codes: list[object] = []

        def spare() -> None:
            try:
                runtime.init(env, config=FAST)
            except SystemExit as exc:
                codes.append(exc.code)

        t = threading.Thread(target=spare)
        t.start()
        peer, _ = next_message(server, "standby")
        server.send(peer, "stop", {"reason": "job finished"})
        t.join(5)
        assert codes == [0]
        next_message(server, "bye")
