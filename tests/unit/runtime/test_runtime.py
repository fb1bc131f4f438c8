"""The in-rank runtime: env derivation per role, standby/promote/stop, heartbeats.

A fake control client stands in for the ZeroMQ one here (speed, no sockets);
test_runtime_control.py runs the same paths against the real control plane.
"""

from __future__ import annotations

import datetime
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from torchpass_slurm.config import SupervisorConfig
from torchpass_slurm.control import messages as m
from torchpass_slurm.errors import ConfigError, ControlPlaneError
from torchpass_slurm.rank import runtime

FAST = SupervisorConfig(heartbeat_interval=0.01)


@dataclass
class Msg:
    kind: str
    body: dict[str, Any]


@dataclass
class FakeClient:
    """Records what is sent; ``inbox`` feeds recv(). Fails if used from two threads."""

    inbox: queue.Queue[Msg] = field(default_factory=queue.Queue)
    sent: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    closed: bool = False
    threads: set[str] = field(default_factory=set)
    args: tuple[str, ...] = ()

    def _touch(self) -> None:
        self.threads.add(threading.current_thread().name)

    def send(self, kind: str, body: dict[str, Any]) -> None:
        self._touch()
        for name, types in m.BODY_SCHEMAS[kind].items():  # the real schema of each kind
            assert isinstance(body.get(name, ...), types), (kind, name, body)
        self.sent.append((kind, dict(body)))

    def recv(self, timeout: datetime.timedelta) -> Msg | None:
        self._touch()
        try:
            return self.inbox.get(timeout=timeout.total_seconds())
        except queue.Empty:
            return None

    def close(self) -> None:
        self.closed = True

    def kinds(self) -> list[str]:
        return [k for k, _ in self.sent]


def factory(client: FakeClient) -> runtime.ClientFactory:
    def make(endpoint: str, secret_file: str, sender: str) -> FakeClient:
        client.args = (endpoint, secret_file, sender)
        return client

    return make


def tp_env(role: str, **extra: str) -> dict[str, str]:
    env = {
        "TORCHPASS_CONTROL": "tcp://ctl:5555",
        "TORCHPASS_SECRET_FILE": "/run/secret",
        "TORCHPASS_ROLE": role,
        "TORCHPASS_JOB_ID": "42",
        "TORCHPASS_NODE": "c2",
        "TORCHPASS_EPOCH": "3",
        "TORCHPASS_NTASKS_PER_NODE": "2",
        "SLURM_LOCALID": "1",
    }
    env.update(extra)
    return env


# --- plain mode ---------------------------------------------------------------------


def test_plain_torchrun_env_is_kept() -> None:
    env = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "n1",
        "MASTER_PORT": "1234",
    }
    rt = runtime.init(env)
    assert (rt.role, rt.rank, rt.world_size, rt.local_rank) == (runtime.Role.PLAIN, 5, 8, 1)
    assert env["MASTER_ADDR"] == "n1" and env["MASTER_PORT"] == "1234"
    rt.close()


def test_plain_srun_env_is_translated_for_torch() -> None:
    env = {
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_JOB_ID": "77",
        "MASTER_ADDR": "c1",
        "MASTER_PORT": "29500",
    }
    rt = runtime.init(env)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")} == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
    }
    assert rt.tag == "77/3/0/-"


def test_plain_single_process_defaults() -> None:
    env: dict[str, str] = {}
    rt = runtime.init(env)
    assert (rt.rank, rt.world_size) == (0, 1)
    assert env["MASTER_ADDR"] == "127.0.0.1"


def test_plain_bad_integer_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="RANK='x'"):
        runtime.init({"RANK": "x"})


def test_multi_rank_without_master_addr_refuses_process_group() -> None:
    rt = runtime.init({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        rt.init_process_group()


# --- active -------------------------------------------------------------------------


def test_active_rank_is_base_plus_localid_and_hello_is_sent() -> None:
    client = FakeClient()
    env = tp_env("active", TORCHPASS_RANK_BASE="4", WORLD_SIZE="6", MASTER_ADDR="c1", MASTER_PORT="29400")
    rt = runtime.init(env, client_factory=factory(client), config=FAST)
    try:
        assert (rt.rank, rt.local_rank, rt.world_size, rt.epoch) == (5, 1, 6, 3)
        assert (env["RANK"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("5", "1", "2")
        assert client.args == ("tcp://ctl:5555", "/run/secret", "c2/1")
        assert client.sent[0] == ("hello", client.sent[0][1])
        assert client.sent[0][1]["rank"] == 5 and client.sent[0][1]["role"] == "active"
    finally:
        rt.close()


def test_active_without_rank_base_is_a_config_error() -> None:
    env = tp_env("active", WORLD_SIZE="6", MASTER_ADDR="c1", MASTER_PORT="1")
    with pytest.raises(ConfigError, match="TORCHPASS_RANK_BASE"):
        runtime.init(env, client_factory=factory(FakeClient()), config=FAST)


def test_unknown_role_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="expected 'active' or 'spare'"):
        runtime.init(tp_env("leader"), client_factory=factory(FakeClient()))


def test_heartbeats_carry_the_step_and_close_says_bye_from_the_same_thread() -> None:
    client = FakeClient()
    env = tp_env("active", TORCHPASS_RANK_BASE="0", WORLD_SIZE="2", MASTER_ADDR="c1", MASTER_PORT="1")
    rt = runtime.init(env, client_factory=factory(client), config=FAST)
    rt.report_step(7)
    deadline = time.monotonic() + 5
    while (
        not any(k == "heartbeat" and b["step"] == 7 for k, b in client.sent) and time.monotonic() < deadline
    ):
        time.sleep(0.01)
    rt.close()
    beats = [b for k, b in client.sent if k == "heartbeat"]
    assert beats and beats[-1] == {"rank": 1, "step": 7, "state": "running"}
    assert client.kinds()[-1] == "bye" and client.closed
    assert client.threads == {"MainThread", "torchpass-heartbeat"}
    assert not any(t.name == "torchpass-heartbeat" for t in threading.enumerate())
    rt.close()  # idempotent


def test_stop_while_active_is_exposed_not_raised() -> None:
    client = FakeClient()
    env = tp_env("active", TORCHPASS_RANK_BASE="0", WORLD_SIZE="2", MASTER_ADDR="c1", MASTER_PORT="1")
    rt = runtime.init(env, client_factory=factory(client), config=FAST)
    client.inbox.put(Msg("stop", {"reason": "fenced"}))
    assert rt.stop_requested.wait(5)
    rt.close()


# --- spare --------------------------------------------------------------------------


PROMOTE = {"rank": 2, "local_rank": 0, "world_size": 4, "master_addr": "c1", "master_port": 29401, "epoch": 4}


def test_spare_blocks_until_promoted_then_runs_as_active() -> None:
    client = FakeClient()
    env = tp_env("spare", SLURM_LOCALID="0")
    done: list[runtime.Runtime] = []
    t = threading.Thread(
        target=lambda: done.append(runtime.init(env, client_factory=factory(client), config=FAST))
    )
    t.start()
    time.sleep(0.1)
    assert not done, "a spare must block in init() until promoted"
    assert client.sent[0] == ("standby", {"node": "c2", "local_rank": 0, "pid": client.sent[0][1]["pid"]})
    assert ("heartbeat", {"rank": None, "step": None, "state": "standby"}) in client.sent
    client.inbox.put(Msg("promote", PROMOTE))
    t.join(5)
    rt = done[0]
    try:
        assert rt.is_spare_promoted and (rt.rank, rt.world_size, rt.epoch) == (2, 4, 4)
        assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"], env["MASTER_PORT"]) == (
            "2",
            "4",
            "c1",
            "29401",
        )
        hello = [b for k, b in client.sent if k == "hello"]
        assert hello and hello[0]["promoted"] is True and hello[0]["rank"] == 2
    finally:
        rt.close()


def test_spare_stopped_exits_with_status_0_after_bye() -> None:
    client = FakeClient()
    client.inbox.put(Msg("stop", {"reason": "job done"}))
    with pytest.raises(SystemExit) as exc:
        runtime.init(tp_env("spare"), client_factory=factory(client), config=FAST)
    assert exc.value.code == 0
    assert client.kinds() == ["standby", "bye"] and client.closed


def test_spare_has_no_rank_before_promotion() -> None:
    rt = runtime.Runtime.from_env(tp_env("spare"), client_factory=factory(FakeClient()), config=FAST)
    with pytest.raises(ControlPlaneError, match="not been promoted"):
        _ = rt.rank
    assert rt.tag == "42/spare/0/-"


def test_spare_standby_timeout() -> None:
    with pytest.raises(ControlPlaneError, match="no promote or stop"):
        runtime.init(
            tp_env("spare"),
            client_factory=factory(FakeClient()),
            config=FAST,
            standby_timeout=datetime.timedelta(seconds=0.05),
        )


def test_malformed_promote_is_a_control_plane_error() -> None:
    client = FakeClient()
    client.inbox.put(Msg("promote", {"rank": 1}))
    with pytest.raises(ControlPlaneError, match="malformed promote"):
        runtime.init(tp_env("spare"), client_factory=factory(client), config=FAST)


# --- logging and imports ------------------------------------------------------------


def test_log_lines_carry_job_rank_epoch_step(caplog: pytest.LogCaptureFixture) -> None:
    rt = runtime.init({"RANK": "1", "WORLD_SIZE": "2", "SLURM_JOB_ID": "9"})
    rt.report_step(12)
    with caplog.at_level("INFO", logger="torchpass_slurm.rank.runtime"):
        rt.log.info("hello")
    assert "[9/1/0/12] hello" in caplog.text


def test_modules_import_without_torch_or_zmq() -> None:
    code = (
        "import sys; import torchpass_slurm.rank.runtime, torchpass_slurm.rank.checkpoint; "
        "print(sorted(m for m in ('torch', 'zmq') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
