"""A rank whose supervisor is gone ends the job once, leaves the record, and tp report says why."""

from __future__ import annotations

import datetime
import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("zmq")

from torchpass_slurm.cli.report import supervisor_lost_line
from torchpass_slurm.control.client import ControlClient
from torchpass_slurm.control.secret import create_secret, load_secret
from torchpass_slurm.control.server import ControlServer
from torchpass_slurm.rank import orphan as orphan_mod
from torchpass_slurm.rank.orphan import (
    EXIT_CUT_OFF,
    EXIT_SUPERVISOR_LOST,
    LEASE,
    Orphan,
)
from torchpass_slurm.rundir.supervisor_lost import RECORD, read_record
from torchpass_slurm.slurm.runner import CommandResult, SubprocessRunner

LOG = logging.LoggerAdapter(logging.getLogger("test"), {})


class Link:
    def __init__(self, down_for: float | None) -> None:
        self.down = down_for

    def link_down_for(self) -> float | None:
        return self.down


class Exited(Exception):
    pass


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    ran: list[list[str]] = []

    def run(self: SubprocessRunner, argv: list[str], **kwargs: Any) -> CommandResult:
        ran.append(list(argv))  # the command the Slurm layer runs for the rank
        return CommandResult(tuple(argv), "")

    def exit_(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr(SubprocessRunner, "run", run)
    monkeypatch.setattr(orphan_mod.os, "_exit", exit_)
    return ran


def env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"TORCHPASS_RUN_DIR": str(tmp_path), "TORCHPASS_JOB_ID": "42", **extra}


def test_within_the_grace_nothing_happens(tmp_path: Path, calls: list[list[str]]) -> None:
    o = Orphan(env(tmp_path), node="c2", sender="c2/0", log=LOG)
    o.check(Link(None))
    o.check(Link(o.grace - 1))
    assert calls == [] and read_record(tmp_path) is None


def test_the_first_rank_past_the_grace_cancels_the_job_and_the_others_only_leave(
    tmp_path: Path, calls: list[list[str]]
) -> None:
    first = Orphan(env(tmp_path), node="c2", sender="c2/0", log=LOG)
    with pytest.raises(Exited) as code:
        first.check(Link(first.grace + 2))
    assert code.value.args == (EXIT_SUPERVISOR_LOST,)
    assert calls == [["scancel", "42"]]
    record = read_record(tmp_path)
    assert record is not None and record["node"] == "c2" and record["job"] == "42"
    second = Orphan(env(tmp_path), node="c3", sender="c3/0", log=LOG)
    with pytest.raises(Exited):
        second.check(Link(second.grace + 5))
    assert calls == [["scancel", "42"]]  # one cancel per job
    assert read_record(tmp_path)["node"] == "c2"  # type: ignore[index]
    line = supervisor_lost_line(tmp_path)
    assert line is not None and "supervisor was lost" in line and "c2/0 on c2 cancelled the job" in line


def test_a_heterogeneous_job_is_cancelled_by_its_leaders_id(tmp_path: Path, calls: list[list[str]]) -> None:
    """tp run names the leader (TORCHPASS_CANCEL_JOB_ID): a step of the training component has
    that component's own id in TORCHPASS_JOB_ID and SLURM_JOB_ID, and scancel of it would leave
    the leader, whose node is the dead one, running (seen on the dev cluster)."""
    leader = env(tmp_path, TORCHPASS_CANCEL_JOB_ID="40", SLURM_JOB_ID="41")
    with pytest.raises(Exited):
        Orphan(leader, node="c2", sender="c2/0", log=LOG).leave(99.0)
    assert calls == [["scancel", "40"]]


def lease(run_dir: Path, age_s: float) -> None:
    """The supervisor's status.json, written ``age_s`` ago by its clock."""
    (run_dir / LEASE).write_text(json.dumps({"job_id": "42", "updated": time.time() - age_s}))


def test_a_rank_cut_off_from_a_living_supervisor_leaves_alone(tmp_path: Path, calls: list[list[str]]) -> None:
    """Issue 22, split brain: a node partitioned from the supervisor for 40 s was replaced live,
    and its old rank then cancelled the whole healthy job. Its supervisor's lease was fresh."""
    lease(tmp_path, age_s=0.8)
    o = Orphan(env(tmp_path), node="c2", sender="c2/0", log=LOG)
    with pytest.raises(Exited) as code:
        o.check(Link(o.grace + 10))
    assert code.value.args == (EXIT_CUT_OFF,)
    assert calls == [] and read_record(tmp_path) is None
    assert supervisor_lost_line(tmp_path) is None


@pytest.mark.parametrize("age_s", [30.0, None])
def test_a_stale_or_missing_lease_means_the_supervisor_is_gone(
    tmp_path: Path, calls: list[list[str]], age_s: float | None
) -> None:
    if age_s is not None:
        lease(tmp_path, age_s)
    o = Orphan(env(tmp_path), node="c2", sender="c2/0", log=LOG)
    with pytest.raises(Exited) as code:
        o.check(Link(o.grace + 10))
    assert code.value.args == (EXIT_SUPERVISOR_LOST,)
    assert calls == [["scancel", "42"]] and read_record(tmp_path) is not None


@pytest.mark.parametrize("text", ["{", "[]", '{"updated": "soon"}', '{"updated": true}'])
def test_a_malformed_lease_is_no_lease(tmp_path: Path, text: str) -> None:
    (tmp_path / LEASE).write_text(text)
    assert Orphan(env(tmp_path), node="c2", sender="c2/0", log=LOG).lease_age() is None


def test_a_grace_of_zero_turns_it_off(
    tmp_path: Path, calls: list[list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHPASS_SUPERVISOR_GRACE", "0")
    Orphan(env(tmp_path), node="c2", sender="c2/0", log=LOG).check(Link(1e6))
    assert calls == []


def test_an_unreadable_record_is_no_record(tmp_path: Path) -> None:
    (tmp_path / RECORD).parent.mkdir(parents=True)
    (tmp_path / RECORD).write_text("{not json")
    assert read_record(tmp_path) is None and supervisor_lost_line(tmp_path) is None


def test_the_link_watch_sees_the_supervisor_go(tmp_path: Path) -> None:
    """A real client: up after its handshake, down once the supervisor's socket is gone."""
    secret = load_secret(create_secret(tmp_path))
    server = ControlServer(secret, "127.0.0.1")
    client = ControlClient(server.endpoint, secret, "c2/0")
    try:
        client.send("heartbeat", {"rank": 1, "step": 0, "state": "running"})
        deadline = time.monotonic() + 10
        while not server.poll(datetime.timedelta(milliseconds=100)) and time.monotonic() < deadline:
            pass
        assert client.link_down_for() is None
        server.close()
        deadline = time.monotonic() + 10
        while client.link_down_for() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        down = client.link_down_for()
        assert down is not None and down >= 0
    finally:
        client.close()
    assert json.dumps(read_record(tmp_path)) == "null"
