"""Per-node heartbeats on the rank side (rank/nodebeat.py): two real heartbeat threads of one
node, the real ipc sockets between them, and fake control clients that record what reaches the
supervisor."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("zmq")

from torchpass_slurm.control import messages as m
from torchpass_slurm.control.secret import create_secret
from torchpass_slurm.rank import nodebeat, runtime
from torchpass_slurm.rank.link import Heartbeat
from torchpass_slurm.rank.rankinfo import RankInfo

from .test_runtime import FakeClient, factory

INTERVAL = 0.05
LOG = logging.LoggerAdapter(logging.getLogger("test"), {})
WAIT_S = 5.0


def place(local: int, ntasks: int = 2) -> RankInfo:
    return RankInfo(
        rank=10 + local,
        world_size=8,
        local_rank=local,
        local_world_size=ntasks,
        master_addr="c1",
        master_port=1,
    )


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "run").mkdir()
    (tmp_path / "tmp").mkdir()
    return {
        "TORCHPASS_NODE_HEARTBEAT": "1",
        "TMPDIR": str(tmp_path / "tmp"),
        "TORCHPASS_EPOCH": "3",
        "TORCHPASS_SECRET_FILE": str(create_secret(tmp_path / "run")),
    }


class Rank:
    """One rank's heartbeat thread, as Runtime starts it, with the beat it would send."""

    def __init__(self, env: dict[str, str], local: int) -> None:
        self.client = FakeClient()
        self.body = {"rank": 10 + local, "step": 0, "state": "sync"}
        self.node = nodebeat.node_beat(env, "42", "c2", place(local), LOG)
        assert self.node is not None
        self.thread = Heartbeat(
            self.client,
            INTERVAL,
            beat=self.beat,
            on_message=lambda msg: None,  # type: ignore[arg-type]
            outbox=__import__("queue").Queue(),
            log=LOG,
            node=self.node,
        )

    def beat(self, state: str | None = None) -> dict[str, Any]:
        return {**self.body, "state": state or self.body["state"]}

    def beats(self) -> list[dict[str, Any]]:
        return [b for k, b in self.client.sent if k == "heartbeat"]

    def stop(self) -> None:
        self.thread.closing.set()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive()


@pytest.fixture
def node(env: dict[str, str]) -> Iterator[tuple[Rank, Rank]]:
    ranks = (Rank(env, 0), Rank(env, 1))
    for r in ranks:
        r.thread.start()
    yield ranks
    for r in ranks:
        if r.thread.is_alive():
            r.stop()


def until(what: Callable[[], object], seconds: float = WAIT_S) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.01)
    raise AssertionError(f"not within {seconds} s")


def entry_of(beat: dict[str, Any], local: int) -> list[Any] | None:
    return next((t for t in beat.get("tasks", []) if t[0] == local), None)


def test_local_rank_0_carries_its_node_and_the_others_beat_only_to_it(node: tuple[Rank, Rank]) -> None:
    zero, one = node
    one.body["step"] = 7
    beat = until(
        lambda: next((b for b in reversed(zero.beats()) if (entry_of(b, 1) or [0, 0, 0])[2] == 7), None)
    )
    assert {k: beat[k] for k in ("rank", "step", "state")} == {"rank": 10, "step": 0, "state": "sync"}
    local, rank, step, state, age_ms, alive = entry_of(beat, 1)  # type: ignore[misc]
    assert (local, rank, step, state, alive) == (1, 11, 7, "sync", True)
    assert isinstance(age_ms, int) and 0 <= age_ms < 1000
    assert [t[0] for t in beat["tasks"]] == [1]  # never itself
    m.encode(m.Message(m.HEARTBEAT, "c2/0", 1, time.time(), beat), b"k" * 32)  # the wire accepts it
    time.sleep(4 * INTERVAL)
    assert one.beats() == []  # nothing periodic from local rank 1 to the supervisor


def test_a_rank_that_stops_beating_keeps_its_entry_with_a_growing_age(node: tuple[Rank, Rank]) -> None:
    zero, one = node
    until(lambda: zero.beats() and entry_of(zero.beats()[-1], 1))
    one.stop()
    assert one.client.kinds() == ["bye"]  # its bye still goes straight to the supervisor
    seen = len(zero.beats())
    until(lambda: len(zero.beats()) >= seen + 8)
    ages = [entry_of(b, 1)[4] for b in zero.beats()[seen:]]  # type: ignore[index]
    assert ages == sorted(ages) and ages[-1] - ages[0] >= 4 * INTERVAL * 1000
    assert ages[-1] >= 8 * INTERVAL * 1000 - 50


def test_a_beat_the_collector_cannot_authenticate_or_place_is_dropped(env: dict[str, str]) -> None:
    import zmq

    collector = nodebeat.node_beat(env, "42", "c2", place(0, ntasks=4), LOG)
    assert isinstance(collector, nodebeat.BeatCollector)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(collector.endpoint)
    secret = bytes.fromhex(Path(env["TORCHPASS_SECRET_FILE"]).read_text().strip())
    body = {"rank": 3, "step": 1, "state": "sync"}

    def signed(sender: str, to: str = "c2/0", key: bytes = secret, **extra: Any) -> list[bytes]:
        return m.encode(
            m.Message(m.HEARTBEAT, sender, time.time_ns(), time.time(), {**body, **extra}, to=to), key
        )

    try:
        for frames in (
            signed("c2/1", key=b"x" * 32),  # another job's secret
            signed("c2/1", to="c2/3"),  # addressed to another rank
            signed("c9/1"),  # another node's rank
            signed("c2/0"),  # itself
            signed("c2/7"),  # no such local rank
            signed("c2/2", state="s" * 65),  # a state the supervisor would refuse
            [b"junk"],
        ):
            push.send_multipart(frames)
        push.send_multipart(signed("c2/3", step=5))  # the one good beat, last
        beat = until(
            lambda: (b := collector.periodic({"rank": 0, "step": 1, "state": "sync"}))["tasks"] and b
        )
        assert [t[:4] for t in beat["tasks"]] == [[3, 3, 5, "sync"]]
        assert collector._receiver.rejected == 3
    finally:
        push.close(linger=0)
        ctx.term()
        collector.close()


def test_the_folder_is_private_and_a_folder_of_anyone_else_means_per_rank_beats(
    env: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    folder = nodebeat.beat_dir(env, "42", "c2")
    relay = nodebeat.node_beat(env, "42", "c2", place(1), LOG)  # local 1 may come first: it makes it
    assert isinstance(relay, nodebeat.BeatRelay)
    relay.close()
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700 and folder.name == f"torchpass-{os.geteuid()}-42-c2"
    os.chmod(folder, 0o755)
    with caplog.at_level(logging.WARNING):
        assert nodebeat.node_beat(env, "42", "c2", place(0), LOG) is None
    assert "mode 0700" in caplog.text
    os.rmdir(folder)
    os.symlink(env["TMPDIR"], folder)
    assert nodebeat.node_beat(env, "42", "c2", place(1), LOG) is None


@pytest.mark.parametrize(("extra", "ntasks"), [({"TORCHPASS_NODE_HEARTBEAT": "0"}, 2), ({}, 1)])
def test_no_node_beat_when_it_is_off_or_alone_on_the_node(
    env: dict[str, str], extra: dict[str, str], ntasks: int
) -> None:
    assert nodebeat.node_beat({**env, **extra}, "42", "c2", place(0, ntasks), LOG) is None


def test_two_runtimes_of_one_node_beat_through_local_rank_0(env: dict[str, str]) -> None:
    """The wiring: Runtime gives its heartbeat thread the node beat that the environment asks for."""
    clients = [FakeClient(), FakeClient()]
    rts = []
    for local, client in enumerate(clients):
        e = {
            **env,
            "TORCHPASS_CONTROL": "tcp://ctl:5555",
            "TORCHPASS_ROLE": "active",
            "TORCHPASS_JOB_ID": "42",
            "TORCHPASS_NODE": "c2",
            "TORCHPASS_NTASKS_PER_NODE": "2",
            "SLURM_LOCALID": str(local),
            "TORCHPASS_RANK_BASE": "4",
            "WORLD_SIZE": "4",
            "MASTER_ADDR": "c1",
            "MASTER_PORT": "1",
        }
        rts.append(
            runtime.init(
                e,
                client_factory=factory(client),
                config=runtime.SupervisorConfig(heartbeat_interval=INTERVAL),
            )
        )
    try:
        rts[1].report_step(3)
        until(
            lambda: any((entry_of(b, 1) or [0, 0, 0])[2] == 3 for k, b in clients[0].sent if k == "heartbeat")
        )
        assert clients[1].kinds() == ["hello"]
    finally:
        for rt in rts:
            rt.close()
    assert clients[1].kinds() == ["hello", "bye"] and clients[0].kinds()[-1] == "bye"
    assert all(t.name != "torchpass-heartbeat" for t in threading.enumerate())


def test_local_rank_0_removes_its_socket_and_the_folder_when_it_closes(env: dict[str, str]) -> None:
    folder = nodebeat.beat_dir(env, "42", "c2")
    collector = nodebeat.node_beat(env, "42", "c2", place(0), LOG)
    assert isinstance(collector, nodebeat.BeatCollector)
    assert collector.endpoint == f"ipc://{folder}/beats-e3.ipc" and os.listdir(folder) == ["beats-e3.ipc"]
    collector.close()
    assert not folder.exists()


def test_a_process_is_alive_until_it_exits_and_a_zombie_counts_as_gone() -> None:
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert nodebeat.process_alive(os.getpid()) and nodebeat.process_alive(child.pid)
        child.kill()
        until(lambda: not nodebeat.process_alive(child.pid))  # a zombie until it is reaped
    finally:
        child.kill()
        child.wait()
    assert not nodebeat.process_alive(child.pid)


def test_local_rank_0_says_which_of_its_nodes_ranks_are_alive(env: dict[str, str]) -> None:
    """Issue 21: an entry tells a rank whose process died from one that is only quiet."""
    collector = nodebeat.node_beat(env, "42", "c2", place(0, ntasks=3), LOG)
    assert isinstance(collector, nodebeat.BeatCollector)
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        for local, pid in ((1, os.getpid()), (2, dead.pid)):
            beat = {"rank": 10 + local, "step": 4, "state": "recovering", "pid": pid}
            collector._take(m.Message(m.HEARTBEAT, f"c2/{local}", 1, time.time(), beat, to="c2/0"))
        tasks = collector.periodic({"rank": 10, "step": 4, "state": "sync"})["tasks"]
        assert [(t[0], t[5]) for t in tasks] == [(1, True), (2, False)]
        m.encode(
            m.Message(
                m.HEARTBEAT, "c2/0", 1, time.time(), {"rank": 10, "step": 4, "state": "sync", "tasks": tasks}
            ),
            b"k" * 32,
        )
    finally:
        collector.close()
