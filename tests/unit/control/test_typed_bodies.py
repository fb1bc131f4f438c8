"""The typed bodies are the one schema: the wire they write is the protocol's, the checks
decode derives from them are the old tables', and a body that does not fit is refused with a
message that names the field."""

from __future__ import annotations

import time
from typing import Any

import pytest

from torchpass_slurm.control import messages as m
from torchpass_slurm.control.bodies import Promote, PromoteMode, Stop
from torchpass_slurm.control.kinds import Kind, ReportKind
from torchpass_slurm.control.rank_bodies import Bye, Heartbeat, Hello, RankStateCopy, Standby, TaskBeat
from torchpass_slurm.control.reports import (
    REPORT_TYPES,
    Agreement,
    HealthWarning,
    LiveReady,
    Report,
    TransferDone,
)
from torchpass_slurm.errors import ControlPlaneError
from torchpass_slurm.mesh import MeshLayout

SECRET = b"t" * 32
_INT, _OPT_INT, _STR = (int,), (int, type(None)), (str,)

#: The hand-written table decode checked against before the bodies became its source.
OLD_BODY_SCHEMAS = {
    "hello": {"node": _STR, "rank": _OPT_INT, "local_rank": _INT, "role": _STR, "pid": _INT},
    "heartbeat": {"rank": _OPT_INT, "step": _OPT_INT, "state": _STR},
    "standby": {"node": _STR, "local_rank": _INT},
    "bye": {},
    "report": {"event": _STR, "fields": (dict,)},
    "rank_state": {"rank": _INT, "step": _INT, "state": (dict,)},
    "promote": {
        "rank": _INT,
        "local_rank": _INT,
        "world_size": _INT,
        "master_addr": _STR,
        "master_port": _INT,
        "epoch": _INT,
    },
    "stop": {"reason": _STR},
    "reconfigure": {"epoch": _INT, "world_size": _INT, "store_addr": _STR, "store_port": _INT},
    "ack": {"seq": _INT},
}


def test_the_derived_required_fields_are_the_old_tables() -> None:
    assert {k: dict(v) for k, v in m.BODY_SCHEMAS.items()} == OLD_BODY_SCHEMAS
    assert set(m.BODY_TYPES) == m.ALL_KINDS


# --- the wire, unchanged: each body written as the rank wrote it by hand ----------------------


@pytest.mark.parametrize(
    ("typed", "wire"),
    [
        (
            Hello(
                node="n1", rank=3, local_rank=1, role="active", pid=42, world_size=4, epoch=0, promoted=False
            ),
            {
                "node": "n1",
                "rank": 3,
                "local_rank": 1,
                "role": "active",
                "pid": 42,
                "world_size": 4,
                "epoch": 0,
                "promoted": False,
            },
        ),
        (Heartbeat(rank=None, step=None, state="standby"), {"rank": None, "step": None, "state": "standby"}),
        (Heartbeat(rank=1, step=7, state="sync", pid=99), {"rank": 1, "step": 7, "state": "sync", "pid": 99}),
        (
            Heartbeat(
                rank=0,
                step=1,
                state="sync",
                tasks=(TaskBeat(1, 1, 7, "sync", 120, True), TaskBeat(2, None, None, "standby", 0)),
            ),
            {
                "rank": 0,
                "step": 1,
                "state": "sync",
                "tasks": [[1, 1, 7, "sync", 120, True], [2, None, None, "standby", 0]],
            },
        ),
        (
            Heartbeat(rank=0, step=1, state="sync", tasks=()),
            {"rank": 0, "step": 1, "state": "sync", "tasks": []},
        ),
        (Standby(node="s1", local_rank=0, pid=5), {"node": "s1", "local_rank": 0, "pid": 5}),
        (Bye(rank=None, step=None, state="done"), {"rank": None, "step": None, "state": "done"}),
        (
            RankStateCopy(2, 8, {"loader": {"pos": 3}}),
            {"rank": 2, "step": 8, "state": {"loader": {"pos": 3}}},
        ),
    ],
)
def test_a_rank_body_is_written_as_the_protocol_says_and_read_back(typed: Any, wire: dict[str, Any]) -> None:
    assert typed.to_body() == wire
    assert type(typed).from_body(wire) == typed


def test_a_report_is_written_as_runtime_report_wrote_it() -> None:
    fields = {"rank": 0, "committed_step": 7, "receivers": [3], "donors": [0, 1], "epoch": 1}
    report = Report.of(ReportKind.AGREEMENT, **fields)
    assert report.to_body() == {"event": "agreement", "fields": fields}
    assert isinstance(report.data, Agreement) and report.data.receivers == (3,)
    assert report.rank == 0 and report.epoch == 1


def test_keys_a_kind_does_not_declare_reach_the_event_log_as_they_came() -> None:
    report = Report.of(
        "transfer_done",
        rank=3,
        donor=0,
        receiver=3,
        step=7,
        bytes=10,
        seconds=0.5,
        retries=0,
        resumed_from=0,
        epoch=1,
        sealed=True,
        newer_field={"x": [1]},
    )
    assert isinstance(report.data, TransferDone) and report.data.sealed is True
    assert report.data.extra == {"newer_field": {"x": [1]}}
    assert report.fields["newer_field"] == {"x": [1]}


def test_a_mesh_is_read_as_a_layout() -> None:
    layout = MeshLayout(("replicate", "shard"), (2, 2), "replicate")
    report = Report.of(ReportKind.LIVE_READY, rank=0, step=0, epoch=0, mesh=layout.to_json())
    assert isinstance(report.data, LiveReady) and report.mesh == layout
    assert report.fields["mesh"] == layout.to_json()


def test_the_health_agent_may_name_its_node() -> None:
    report = Report.of(ReportKind.HEALTH_WARNING, rank=0, node="n1", status="WARNING", summary="ECC")
    assert report.data == HealthWarning(rank=0, node="n1", status="WARNING", summary="ECC")


def test_every_report_kind_has_its_fields_class() -> None:
    assert set(REPORT_TYPES) == set(ReportKind)


# --- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "body", "said"),
    [
        (Hello, {"node": "n1", "rank": 0, "local_rank": 0, "role": "active"}, "lacks the field 'pid'"),
        (
            Hello,
            {"node": "n1", "rank": "0", "local_rank": 0, "role": "active", "pid": 1},
            "'rank' is str; expected int or null",
        ),
        (Heartbeat, {"rank": 0, "step": True, "state": "x"}, "'step' is bool; expected int or null"),
        (Heartbeat, {"rank": 0, "step": 1, "state": "x", "tasks": [[1, 1, 7, "sync"]]}, "task entry"),
        (Heartbeat, {"rank": 0, "step": 1, "state": "x", "tasks": {}}, "'tasks' is dict; expected list"),
        (Standby, {"node": 1, "local_rank": 0}, "'node' is int; expected str"),
        (RankStateCopy, {"rank": 0, "step": -1, "state": {}}, "step tag is -1"),
    ],
)
def test_a_body_that_does_not_fit_is_refused_naming_the_field(
    cls: Any, body: dict[str, Any], said: str
) -> None:
    with pytest.raises(ControlPlaneError, match=said):
        cls.from_body(body)


@pytest.mark.parametrize(
    ("event", "fields", "said"),
    [
        (
            "agreement",
            {"rank": 0, "committed_step": 7, "epoch": 1, "donors": [0, "1"]},
            "'donors' holds a str; expected a list of int",
        ),
        (
            "group_rebuilt",
            {"rank": 0, "epoch": 1, "step": "3"},
            "'step' is str; expected int",
        ),  # undeclared here
        ("first_step", {"rank": 0, "step": 3, "epoch": 1, "job": "x"}, "reserved"),
        ("transfer_done", {"rank": 0, "epoch": 1, "sealed": 1}, "'sealed' is int; expected bool"),
    ],
)
def test_a_report_that_does_not_fit_is_refused(event: str, fields: dict[str, Any], said: str) -> None:
    with pytest.raises(ControlPlaneError, match=said):
        Report.of(event, **fields)


def test_decode_hands_over_the_typed_body_it_checked() -> None:
    beat = Heartbeat(rank=1, step=7, state="sync", tasks=(TaskBeat(1, 1, 7, "sync", 5, False),))
    sent = m.Message(Kind.HEARTBEAT, "n1/0", 1, time.time(), beat.to_body())
    got = m.decode(m.encode(sent, SECRET), SECRET, allowed=m.WORKER_KINDS)
    assert got == sent and got.typed == beat and m.body_of(got, Heartbeat) is got.typed
    assert m.body_of(sent, Heartbeat) == beat  # not decoded here: read now


def test_the_spare_reads_its_promote_once_with_defaults_for_what_an_old_supervisor_left_out() -> None:
    body = {
        "rank": 1,
        "local_rank": 0,
        "world_size": 2,
        "master_addr": "n1",
        "master_port": 29500,
        "epoch": 1,
    }
    sent = m.Message(Kind.PROMOTE, m.SUPERVISOR, 1, time.time(), body, to="s1/0")
    got = m.decode(m.encode(sent, SECRET), SECRET, allowed=m.SUPERVISOR_KINDS)
    promote = m.body_of(got, Promote)
    assert promote is got.typed and promote.mode == PromoteMode.RESTART and promote.store_addr == ""
    assert m.body_of(
        m.decode(
            m.encode(m.Message(Kind.STOP, m.SUPERVISOR, 2, time.time(), {"reason": "x"}), SECRET), SECRET
        ),
        Stop,
    ) == Stop("x")
