"""The event log: durable appends, concurrent appenders, torn lines."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest

from torchpass_slurm.errors import EventLogError
from torchpass_slurm.rundir import events as ev
from torchpass_slurm.rundir.events import Event, EventLog, read_events


def clock() -> float:
    return 1_700_000_000.5


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "run" / ev.EVENTS_FILE


def test_append_and_read(path: Path) -> None:
    with EventLog(path, job="4242", clock=clock) as log:
        a = log.append(ev.STARTED, nodes=["n1", "n2"])
        log.epoch = 1
        b = log.append(ev.SPARE_PROMOTED, node="s1", replaces="n2", ranks=range(4, 6), dir=path.parent)
        c = log.append(ev.NODE_DOWN, epoch=7, node="n2")
    assert a == Event(clock(), "started", "4242", 0, {"nodes": ["n1", "n2"]})
    assert b.epoch == 1 and c.epoch == 7
    assert read_events(path) == [
        a,
        Event(
            clock(),
            "spare_promoted",
            "4242",
            1,
            {"node": "s1", "replaces": "n2", "ranks": [4, 5], "dir": str(path.parent)},
        ),
        c,
    ]


def test_each_line_is_one_json_object_with_the_common_keys(path: Path) -> None:
    with EventLog(path, job="1") as log:
        log.append(ev.FINISHED, steps=10)
    (line,) = path.read_text().splitlines()
    obj = json.loads(line)
    assert set(obj) == {"ts", "kind", "job", "epoch", "steps"} and isinstance(obj["ts"], float)


def test_appends_to_an_existing_log(path: Path) -> None:
    with EventLog(path) as log:
        log.append(ev.SUBMITTED)
    with EventLog(path) as log:
        log.append(ev.STARTED)
    assert [e.kind for e in read_events(path)] == ["submitted", "started"]


def test_bad_appends(path: Path) -> None:
    with EventLog(path) as log:
        with pytest.raises(EventLogError, match="lower_snake_case"):
            log.append("Node Down")
        with pytest.raises(EventLogError, match="may not be named job, ts"):
            log.append(ev.FAILED, ts=1, job="x")
        with pytest.raises(EventLogError, match="not JSON"):
            log.append(ev.FAILED, what=object())
    with pytest.raises(EventLogError, match="closed"):
        log.append(ev.FAILED)
    assert read_events(path) == []


def _append_many(path: str, who: int) -> None:
    with EventLog(Path(path), job=str(who)) as log:
        for i in range(50):
            log.append(ev.HEARTBEAT_LOST, i=i, pad="x" * 2000)


def test_concurrent_appenders_never_interleave(path: Path) -> None:
    EventLog(path).close()
    procs = [multiprocessing.Process(target=_append_many, args=(str(path), w)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    events = read_events(path)
    assert len(events) == 200
    for w in range(4):
        assert [e.fields["i"] for e in events if e.job == str(w)] == list(range(50))


def started_then_torn(path: Path, fragment: bytes) -> None:
    """A log with one event, then a write that a crash cut short."""
    with EventLog(path) as log:
        log.append(ev.STARTED)
    with path.open("ab") as f:
        f.write(fragment)


def test_torn_last_line_is_skipped(path: Path) -> None:
    started_then_torn(path, b'{"epoch": 0, "job": "", "kind": "fin')
    assert [e.kind for e in read_events(path)] == ["started"]


def test_next_appender_marks_the_torn_line(path: Path) -> None:
    started_then_torn(path, b'{"epoch": 0, "kin')
    with EventLog(path) as log:
        log.append(ev.RESTARTED)
    assert [e.kind for e in read_events(path)] == ["started", "log_repaired", "restarted"]


def test_garbage_in_the_middle_is_an_error(path: Path) -> None:
    started_then_torn(path, b"hello world\n")  # a complete line, but not an event
    with EventLog(path) as log:
        log.append(ev.FINISHED)
    with pytest.raises(EventLogError, match=r"events.jsonl:2 is not a valid event"):
        read_events(path, strict=True)
    events = read_events(path)  # by default: skipped, and said
    assert [e.kind for e in events] == ["started", "finished"] and events.skipped == (2,)


@pytest.mark.parametrize(
    "line",
    [
        b"[1]",
        b'{"kind": "x"}',
        b'{"ts": "now", "kind": "x", "job": "", "epoch": 0}',
        b'{"ts": 1, "kind": "x", "job": "", "epoch": true}',
    ],
)
def test_lines_that_are_not_events(path: Path, line: bytes) -> None:
    path.parent.mkdir(parents=True)
    path.write_bytes(line + b"\n")
    with pytest.raises(EventLogError, match=":1 is not a valid event"):
        read_events(path, strict=True)
    events = read_events(path)
    assert events == [] and events.skipped == (1,)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(EventLogError, match="cannot read"):
        read_events(tmp_path / "nope.jsonl")


@pytest.mark.parametrize(
    "fields",
    [
        {"step": float("inf")},
        {"loss": float("nan")},
        {"step": 10**30},
        {"x": [[[[[[[[[[[[[[[[[0]]]]]]]]]]]]]]]]]},
    ],
    ids=["inf", "nan", "huge-int", "deep"],
)
def test_append_refuses_what_the_reader_could_not_read(path: Path, fields: dict[str, object]) -> None:
    with EventLog(path) as log:
        with pytest.raises(EventLogError, match="JSON"):
            log.append("resumed", **fields)
        log.append("resumed", step=3, ranks=[0, 1], detail={"a": [1.5, None, True]})
    (event,) = read_events(path)
    assert event.fields == {"step": 3, "ranks": [0, 1], "detail": {"a": [1.5, None, True]}}


@pytest.mark.parametrize(
    "line",
    [
        b'{"ts": 1, "kind": "x", "job": "", "epoch": 0, "a": ' + b"[" * 30_000 + b"]" * 30_000 + b"}",
        b'{"ts": 1, "kind": "x", "job": "", "epoch": 0, "step": Infinity}',
        b'{"ts": 1, "kind": "x", "job": "", "epoch": 0, "step": ' + b"9" * 400 + b"}",
        b'{"ts": 1, "kind": "x", "job": "", "epoch": "1"}',
        b"\xff\xfe",
    ],
    ids=["deep", "infinity", "400-digits", "string-epoch", "not-utf8"],
)
def test_a_hostile_line_is_skipped_and_counted(path: Path, line: bytes) -> None:
    with EventLog(path) as log:
        log.append(ev.STARTED)
    with path.open("ab") as f:
        f.write(line + b"\n")
    with EventLog(path) as log:
        log.append(ev.FINISHED)
    events = read_events(path)
    assert [e.kind for e in events] == ["started", "finished"] and events.skipped == (2,)


def test_a_planted_link_is_never_followed(tmp_path: Path) -> None:
    """Issue 22: whoever could write the run folder planted events.jsonl as a link to a file of
    the job's owner; the supervisor appended to that file."""
    target = tmp_path / "elsewhere"
    target.write_bytes(b"the owner's file\n")
    (tmp_path / ev.EVENTS_FILE).symlink_to(target)
    with pytest.raises(EventLogError, match="is a symbolic link; refusing to follow it"):
        ev.EventLog(tmp_path / ev.EVENTS_FILE, job="1")
    assert target.read_bytes() == b"the owner's file\n"


def test_an_event_log_that_is_not_a_file_is_refused(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / ev.EVENTS_FILE)
    with pytest.raises(EventLogError, match="is not a regular file"):
        ev.EventLog(tmp_path / ev.EVENTS_FILE, job="1")


# --- kinds ------------------------------------------------------------------------------------


def test_every_report_the_supervisor_forwards_is_an_event_kind() -> None:
    from torchpass_slurm.control.kinds import ReportKind
    from torchpass_slurm.supervisor.loop import RANK_EVENTS

    forwarded = {*RANK_EVENTS, ReportKind.HEALTH_WARNING}
    assert {str(k) for k in forwarded} <= {k.value for k in ev.EventKind}


def test_the_module_names_are_the_enum_and_a_plain_string_still_appends(path: Path) -> None:
    assert ev.MIGRATION_DONE is ev.EventKind.MIGRATION_DONE and ev.STARTED == "started"
    with EventLog(path, job="1", clock=clock) as log:
        typed = log.append(ev.EventKind.AGREEMENT, committed_step=3)
        plain = log.append("custom_kind", x=1)
    assert type(typed.kind) is str and typed.kind == "agreement" and plain.kind == "custom_kind"
    assert [e.kind for e in read_events(path)] == ["agreement", "custom_kind"]
