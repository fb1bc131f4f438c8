"""The structured event log: append-only JSON lines in ``RUN_DIR/events.jsonl``.

Facts that others must count (faults, promotions, restarts) are written here,
one JSON object per line::

    {"epoch": 1, "job": "4242", "kind": "spare_promoted", "node": "s1", "replaces": "n2", "ts": 1718000000.5}

Every line has ``ts`` (unix seconds, float), ``kind``, ``job`` and ``epoch``;
the other keys are the event's fields. Writing: each event is one ``write``
on a descriptor opened with ``O_APPEND``, then ``fsync``, so appenders on one
host never interleave lines and an event that :meth:`EventLog.append` returned
is on disk. (On NFS, ``O_APPEND`` is not atomic between *different* clients:
let one process per host append.)

Crashes. A crash mid-write can leave a torn last line. :func:`read_events`
skips it. The next :class:`EventLog` opened on the file ends the torn line and
writes a :data:`LOG_REPAIRED` event right after it, so the log stays
append-only and the reader knows the fragment before that event is not
garbage.

What is written is what can be read: :meth:`EventLog.append` refuses a field
that is not plain JSON by the rules of :mod:`torchpass_slurm.jsonsafe`
(finite numbers, integers within 64 bits, nesting at most
:data:`MAX_FIELD_NESTING` deep), so that a malformed report a rank sent
cannot make the log unreadable. Any other bad line (an edit, another writer)
is skipped by :func:`read_events` with a warning and its line number in
:attr:`Events.skipped`; ``strict=True`` makes it an error instead.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import json
import logging
import os
import re
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchpass_slurm import jsonsafe
from torchpass_slurm.errors import EventLogError
from torchpass_slurm.strenum import StrEnum

__all__ = [
    "EventKind",
    "SUBMITTED",
    "STARTED",
    "WORKER_UP",
    "HEARTBEAT_LOST",
    "RANK_HUNG",
    "STEP_EXITED",
    "NODE_DOWN",
    "GPU_FAILED",
    "DRAIN_SEEN",
    "SPARE_PROMOTED",
    "SPARE_LOST",
    "SPARE_REQUESTED",
    "SPARE_ADDED",
    "SPARE_REFUSED",
    "HOLDING",
    "RESTARTED",
    "FINISHED",
    "FAILED",
    "MIGRATION_STARTED",
    "GROUP_REBUILT",
    "AGREEMENT",
    "TRANSFER_DONE",
    "FIRST_STEP",
    "MIGRATION_DONE",
    "HEALTH_WARNING",
    "FENCED",
    "DRAIN_DEFERRED",
    "NODE_RELEASED",
    "MESH_LAYOUT",
    "LOG_REPAIRED",
    "EVENTS_FILE",
    "Event",
    "Events",
    "EventLog",
    "read_events",
]

logger = logging.getLogger(__name__)

#: File name of the event log inside the run directory.
EVENTS_FILE = "events.jsonl"

# --- kinds ------------------------------------------------------------------------


class EventKind(StrEnum):
    """The kind of an event-log line. The supervisor writes these; a line of any other
    lower_snake_case kind (a newer version's) is still read. The kinds a rank reports and the
    supervisor forwards as they are share their :class:`~torchpass_slurm.control.kinds.ReportKind`
    value (a test holds that every forwarded report kind is one of these)."""

    SUBMITTED = "submitted"  # tp-submit handed the job to sbatch
    STARTED = "started"  # the supervisor started in the batch step
    WORKER_UP = "worker_up"  # a rank said hello
    HEARTBEAT_LOST = "heartbeat_lost"  # a rank missed its heartbeats
    RANK_HUNG = "rank_hung"  # a rank still heartbeats but makes no step progress while its peers wait
    STEP_EXITED = "step_exited"  # an srun step (one node) ended
    NODE_DOWN = "node_down"  # Slurm reports a node of the job down / gone
    GPU_FAILED = "gpu_failed"  # a node's health agent saw a GPU fault that takes the node now (detail=)
    DRAIN_SEEN = "drain_seen"  # an admin drain on a node of the job
    SPARE_PROMOTED = "spare_promoted"  # a spare took over a failed node's slot
    SPARE_LOST = "spare_lost"  # a spare died on standby
    SPARE_REQUESTED = "spare_requested"  # the pool is short: Slurm is asked for a node (held=, target=)
    SPARE_ADDED = (
        "spare_added"  # a node joined as a spare (node=, seconds=, returned=: it lost only its rank)
    )
    SPARE_REFUSED = "spare_refused"  # Slurm gave no node for the pool (error=, seconds=)
    HOLDING = "holding"  # no spare: the committed step is held for one (failed=, wait_s=, detail=)
    RESTARTED = "restarted"  # fell back to checkpoint-restart
    FINISHED = "finished"  # the training ended well (exit_code=, restarts=, supervisor_cpu_s=, srun_cpu_s=)
    FAILED = "failed"  # the job gave up
    # live migration (docs/protocol.md, "Recovery"); the fields each carries are listed there
    MIGRATION_STARTED = "migration_started"  # supervisor: failed nodes -> spares, new epoch (chained_from=)
    MIGRATION_DONE = "migration_done"  # supervisor: resolution=live|checkpoint|regroup|deferred,
    # lost_steps=, planned=, at_end= (closed when the training completed), detail=
    FENCED = (
        "fenced"  # a task of a lost step spoke again: ignored, told to stop (node=, sender=, message_kind=)
    )
    DRAIN_DEFERRED = "drain_deferred"  # a drained node keeps its ranks until the job ends (reason=, detail=)
    NODE_RELEASED = "node_released"  # a drained or lost node left the job (released=, reason=drained|lost)
    MESH_LAYOUT = "mesh_layout"  # the device mesh the first sharded rank reported (dims=, shape=, replicate=)
    LOG_REPAIRED = "log_repaired"  # a torn line before this one was left by a crash
    # reports of a rank, forwarded by the supervisor (their fields: control/reports.py)
    GROUP_REBUILT = "group_rebuilt"  # a rank: the new epoch's process group is up (seconds=)
    AGREEMENT = "agreement"  # rank 0: the committed step every rank now holds (committed_step=)
    TRANSFER_DONE = "transfer_done"  # a receiver: state received (donor=, bytes=, seconds=, retries=)
    FIRST_STEP = "first_step"  # rank 0: the first step of the new epoch committed (step=)
    RELEASED = "released"  # a rank of a drained node handed over and left the job (step=)
    RANK_STATE_MISSING = "rank_state_missing"  # a rank that took over has no copy of its rank state
    HEALTH_WARNING = "health_warning"  # a node's in-job agent saw WARNING/CRITICAL (status=, summary=)


# The kinds by their old module-level names (callers may pass these, or any EventKind).
SUBMITTED, STARTED, WORKER_UP = EventKind.SUBMITTED, EventKind.STARTED, EventKind.WORKER_UP
HEARTBEAT_LOST, RANK_HUNG, STEP_EXITED = EventKind.HEARTBEAT_LOST, EventKind.RANK_HUNG, EventKind.STEP_EXITED
NODE_DOWN, DRAIN_SEEN, SPARE_PROMOTED = EventKind.NODE_DOWN, EventKind.DRAIN_SEEN, EventKind.SPARE_PROMOTED
SPARE_LOST, SPARE_REQUESTED, SPARE_ADDED = (
    EventKind.SPARE_LOST,
    EventKind.SPARE_REQUESTED,
    EventKind.SPARE_ADDED,
)
SPARE_REFUSED, HOLDING, RESTARTED = EventKind.SPARE_REFUSED, EventKind.HOLDING, EventKind.RESTARTED
FINISHED, FAILED, MIGRATION_STARTED = EventKind.FINISHED, EventKind.FAILED, EventKind.MIGRATION_STARTED
GROUP_REBUILT, AGREEMENT, TRANSFER_DONE = (
    EventKind.GROUP_REBUILT,
    EventKind.AGREEMENT,
    EventKind.TRANSFER_DONE,
)
FIRST_STEP, MIGRATION_DONE, HEALTH_WARNING = (
    EventKind.FIRST_STEP,
    EventKind.MIGRATION_DONE,
    EventKind.HEALTH_WARNING,
)
FENCED, DRAIN_DEFERRED, NODE_RELEASED = EventKind.FENCED, EventKind.DRAIN_DEFERRED, EventKind.NODE_RELEASED
MESH_LAYOUT, LOG_REPAIRED, GPU_FAILED = EventKind.MESH_LAYOUT, EventKind.LOG_REPAIRED, EventKind.GPU_FAILED

#: Deepest nesting of lists and objects in one line (the line's own object is level 1).
MAX_FIELD_NESTING = 16
#: Keys every line has; an event's own fields may not use them.
RESERVED_KEYS = frozenset({"ts", "kind", "job", "epoch"})
_KIND_RE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


@dataclass(frozen=True)
class Event:
    """One line of the event log."""

    ts: float
    kind: str
    job: str
    epoch: int
    fields: Mapping[str, Any] = field(default_factory=dict)

    def to_line(self) -> bytes:
        """The JSON line (with its newline) that records this event."""
        obj = {**self.fields, "ts": self.ts, "kind": self.kind, "job": self.job, "epoch": self.epoch}
        try:
            text = json.dumps(obj, sort_keys=True, allow_nan=False, default=_jsonable)
        except (TypeError, ValueError, RecursionError) as exc:
            raise EventLogError(f"event {self.kind!r} has a field that is not JSON: {exc}") from None
        return (text + "\n").encode("utf-8")


class EventLog:
    """Appender to one event log file. Use as a context manager or call :meth:`close`.

    ``job`` and ``epoch`` are written into every event; the supervisor sets
    :attr:`epoch` whenever the membership changes.
    """

    def __init__(
        self,
        path: Path,
        *,
        job: str = "",
        epoch: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(path)
        self.job = job
        self.epoch = epoch
        self._clock = clock
        flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, flags, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a planted link would send the job's events elsewhere
                raise EventLogError(
                    f"the event log {self.path} is a symbolic link; refusing to follow it",
                    hint="remove it: the run folder should hold only what tp wrote",
                ) from None
            raise EventLogError(f"cannot open the event log {self.path}: {exc.strerror}") from None
        if not stat.S_ISREG(os.fstat(self._fd).st_mode):
            os.close(self._fd)
            raise EventLogError(
                f"the event log {self.path} is not a regular file", hint="remove it and start again"
            )
        self._repair_torn_tail()

    def append(self, kind: EventKind | str, *, epoch: int | None = None, **fields: Any) -> Event:
        """Write one event durably and return it.

        ``kind`` is an :class:`EventKind` (a plain lower_snake_case string is still accepted).
        ``epoch`` overrides :attr:`epoch` for this event only. Field names
        ``ts``, ``kind`` and ``job`` are reserved.
        """
        kind = str(kind)
        if not _KIND_RE.match(kind):
            raise EventLogError(f"event kind {kind!r} is not a lower_snake_case name")
        clash = RESERVED_KEYS & set(fields)
        if clash:
            raise EventLogError(f"event fields may not be named {', '.join(sorted(clash))}")
        if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int)):
            raise EventLogError(f"event {kind!r} has the epoch {epoch!r}; an epoch is an integer")
        event = Event(self._clock(), kind, self.job, self.epoch if epoch is None else epoch, fields)
        line = event.to_line()
        try:  # read back by the reader's rules: what it cannot read is never written
            jsonsafe.loads(line.decode("utf-8"), max_depth=MAX_FIELD_NESTING)
        except jsonsafe.JSONRefused as exc:
            raise EventLogError(f"event {kind!r} has a field that is not plain JSON: it {exc}") from None
        self._write(line)
        return event

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _write(self, line: bytes) -> None:
        if self._fd < 0:
            raise EventLogError(f"the event log {self.path} is closed")
        try:
            with _locked(self._fd):
                written = os.write(self._fd, line)  # one write: O_APPEND keeps it whole
                os.fsync(self._fd)  # os.write is unbuffered; fsync makes it durable
        except OSError as exc:
            raise EventLogError(f"cannot write to the event log {self.path}: {exc.strerror}") from None
        if written != len(line):
            raise EventLogError(f"short write to the event log {self.path}: {written} of {len(line)} bytes")

    def _repair_torn_tail(self) -> None:
        # Under the lock, so that another appender's write in progress is never
        # mistaken for a line torn by a crash.
        with _locked(self._fd):
            size = os.fstat(self._fd).st_size
            if size == 0:
                return
            if os.pread(self._fd, 1, size - 1) == b"\n":  # the file opened, not the path again
                return
            logger.warning("event log %s ends in a torn line (a crash mid-write); marking it", self.path)
            repaired = Event(self._clock(), LOG_REPAIRED, self.job, self.epoch, {})
            os.write(self._fd, b"\n" + repaired.to_line())
            os.fsync(self._fd)


@contextlib.contextmanager
def _locked(fd: int) -> Iterator[None]:
    """An exclusive advisory lock on the log while one line is checked or written."""
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


class Events(list[Event]):
    """The events of a log, in file order, and the lines that were skipped as not events."""

    #: 1-based numbers of the lines skipped because they are not events (torn lines not counted)
    skipped: tuple[int, ...] = ()


def read_events(path: Path, *, strict: bool = False) -> Events:
    """All events in the log at ``path``, in file order.

    Skips blank lines, a torn last line, and a torn line followed by a
    :data:`LOG_REPAIRED` event. Any other line that is not a valid event is
    skipped with a warning and its number recorded in :attr:`Events.skipped`
    (``strict=True``: raises EventLogError with the line number instead).
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise EventLogError(f"cannot read the event log {path}: {exc.strerror}") from None
    lines = data.split(b"\n")
    parsed = [_parse_line(line) for line in lines]
    events = Events()
    skipped: list[int] = []
    for i, (line, event) in enumerate(zip(lines, parsed, strict=True)):
        if event is not None:
            events.append(event)
        elif line.strip() and not _is_torn(i, lines, parsed):
            if strict:
                raise EventLogError(
                    f"{path}:{i + 1} is not a valid event: {line[:80]!r}",
                    hint="the event log was edited or written by something else; fix or remove that line",
                )
            skipped.append(i + 1)
            logger.warning("%s:%d is not a valid event, skipped: %r", path, i + 1, line[:80])
    events.skipped = tuple(skipped)
    return events


def _is_torn(i: int, lines: list[bytes], parsed: list[Event | None]) -> bool:
    """Whether the bad line ``i`` is a crash's torn write (and so may be skipped)."""
    if i == len(lines) - 1:  # no newline after it: the last write never finished
        logger.warning("skipping a torn last line of the event log: %r", lines[i][:80])
        return True
    following = parsed[i + 1] if i + 1 < len(parsed) else None
    return following is not None and following.kind == LOG_REPAIRED


def _parse_line(line: bytes) -> Event | None:
    try:
        obj = jsonsafe.loads(line.decode("utf-8"), max_depth=MAX_FIELD_NESTING)
    except (UnicodeDecodeError, jsonsafe.JSONRefused):
        return None
    if not isinstance(obj, dict) or not RESERVED_KEYS <= set(obj):
        return None
    ts, kind, job, epoch = obj.pop("ts"), obj.pop("kind"), obj.pop("job"), obj.pop("epoch")
    if (
        isinstance(ts, bool)
        or not isinstance(ts, (int, float))
        or not isinstance(kind, str)
        or not isinstance(job, str)
        or isinstance(epoch, bool)
        or not isinstance(epoch, int)
    ):
        return None
    return Event(float(ts), kind, job, epoch, obj)


def _jsonable(value: object) -> Any:
    """JSON form of the few non-JSON types events commonly carry."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, range):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")
