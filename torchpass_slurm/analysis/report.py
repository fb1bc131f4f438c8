"""Faults and recoveries, read back from a job's event log (``tp report``).

Pure: :func:`analyse` turns a list of :class:`~torchpass_slurm.rundir.events.Event`
into a :class:`JobReport`: its faults, each with its class, its recovery's
resolution and steps, and the recovery-time split (:class:`Phases`). The
totals over jobs, the summary line and the JSON documents are in
:mod:`torchpass_slurm.analysis.report_totals`. Nothing here reads files or
imports rich: the command in :mod:`torchpass_slurm.cli.report` does, and draws
the cells and the legend (``tp report --explain``, a short form of the rules).

The rules:

* **Classes.** Every fault has one class (:data:`CLASSES`):

  - *unplanned*: a detection (below);
  - *pre-emptive*: a drain the job made itself on a health warning: its
    reason is one ``faults.pre_emptive_drain_reason`` wrote (``torchpass: pre-emptive: ...``),
    or the node had a ``health_warning`` before its ``drain_seen``;
  - *planned*: any other drain of an active node (an admin's).

  A drain counts once the job acts on it: ``migration_started`` with
  ``mode="planned"`` (its ``failed`` node moves to a spare), or
  ``drain_deferred`` (the node keeps its ranks until the job ends: resolution
  ``deferred``, 0 steps lost, 0 recomputed, a recovery of its own). A drained
  node is then out of the job, as a failed one is. A drained spare gives
  ``spare_lost``: a spare fault. A drain never acted on (the job ended first)
  is not counted.
* **Unplanned fault.** One detection event -- ``heartbeat_lost``, ``rank_hung``,
  ``node_down``, or ``step_exited`` with an ``exit_code`` other than 0 (0 is a
  rank's normal end) -- on an *active* node. Detections of the same node
  within one recovery, or later ones of a node that failed and has not
  rejoined (echoes: its step exits after its heartbeats were lost), count
  once; the first one's ``ts`` is the detection time. Detections on a spare,
  and ``spare_lost``, are *spare faults*: counted apart, they cost no
  progress. A role missing from the event is taken from the membership the
  log shows (``started``' ``spares``, less the promoted ones; a lost spare
  stays a spare).
* **Recovery.** Opened by the first fault while none is open (a detection,
  or a planned ``migration_started``); more faults before it ends join it (and
  share its outcome). It ends at ``migration_done``, ``restarted``, ``failed``
  or ``finished``. A ``migration_started`` with ``chained_from`` continues the
  recovery of that epoch (a fault during a recovery, a live move that fell
  back to a restart, a restart before the ranks resumed): the faults since
  join it, and its one ``migration_done`` gives the chain's steps. Migration
  events (``group_rebuilt``, ``agreement``, ``transfer_done``, ``first_step``,
  ``migration_done``) belong to the recovery one of whose
  ``migration_started`` has their epoch, else to the open one.
* **Resolution.** ``deferred`` for a deferred drain; else
  ``migration_done.resolution`` (live | regroup | checkpoint; see torchpass_slurm.faults.Resolution) if
  present; else ``restarted`` with ``from_checkpoint`` -> checkpoint; else a
  ``failed`` event while the recovery is open -> fatal; else unresolved.
* **Fallback.** ``migration_started.fallback``: why a recovery that could have been live
  was a restart (``no replica``: a lost rank's every replica was lost too).
* **Phases** (seconds), consecutive intervals between these marks::

      last heartbeat --detection--> detected --decision--> migration_started
          --rebuild--> group_rebuilt --agreement--> agreement
          --transfer--> transfer_done --first_step--> first_step

  ``group_rebuilt`` and ``transfer_done`` are the *last* of the migration (the
  group is up, the state is in place, when the last rank says so);
  ``agreement`` and ``first_step`` the first. ``last_heartbeat`` comes from
  ``migration_started`` (a number, or ``{node: ts}``). A drain's *detected*
  mark is its ``drain_seen`` (detector ``drain``), a pre-emptive one's the
  node's ``health_warning`` (detector ``health``); there is nothing to detect,
  so its detection phase is null. total = first_step - detected. A phase whose
  either end is not in the log, or whose end comes before its start (a fault
  detected after its recovery began), is null: never an invented number.
* **Steps.** Committed steps lost and steps recomputed come from
  ``migration_done`` (``lost_steps``, ``recomputed_steps``); without it they
  are unknown (null). They are per recovery: totals add each recovery once,
  however many faults it handled, in the class of the fault that opened it. A
  fault with *no lost progress* is one whose recovery has ``lost_steps == 0``;
  its share is taken over all the faults of a class, and over all faults (a
  fault whose loss is unknown is not one with no lost progress).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torchpass_slurm.analysis.phases import PHASES, Phases, last_heartbeat, round_ms, split_phases
from torchpass_slurm.config import NodeRole
from torchpass_slurm.faults import FaultClass, Resolution, is_pre_emptive_drain
from torchpass_slurm.rundir import events as ev
from torchpass_slurm.rundir.events import Event

__all__ = [
    "CLASSES",
    "PHASES",
    "RESOLUTIONS",
    "FaultRecord",
    "JobReport",
    "Phases",
    "SpareFault",
    "analyse",
    "is_detection",
]

#: Detection kinds (``step_exited`` only with a non-zero exit code).
DETECTION_KINDS = frozenset({ev.HEARTBEAT_LOST, ev.RANK_HUNG, ev.NODE_DOWN, ev.STEP_EXITED, ev.GPU_FAILED})
#: Events that end the open recovery.
CLOSING_KINDS = frozenset({ev.MIGRATION_DONE, ev.RESTARTED, ev.FAILED, ev.FINISHED})
#: Fault classes, in the order they are reported.
CLASSES = tuple(c.value for c in FaultClass)
#: Resolutions, in the order they are reported; None is "unresolved".
RESOLUTIONS: tuple[str | None, ...] = (
    Resolution.LIVE.value,
    Resolution.REGROUP.value,
    Resolution.CHECKPOINT.value,
    Resolution.DEFERRED.value,
    Resolution.FATAL.value,
    None,
)

# --- results ------------------------------------------------------------------


@dataclass(frozen=True)
class FaultRecord:
    """One fault of an active node (of any class) and how its recovery went."""

    ts: float
    node: str
    kind: str
    detector: str
    detail: str
    exit_code: int | None
    recovery: int
    resolution: str | None
    lost_steps: int | None
    recomputed_steps: int | None
    phases: Phases
    fault_class: str  # unplanned | pre-emptive | planned
    fallback: str | None = None  # why its recovery was not live though it could have been
    held_s: float | None = None  # how long the job held its step for a spare before the move

    def as_dict(self) -> dict[str, Any]:
        """The fault's JSON form: the time rounded to milliseconds, the phases as :meth:`Phases.as_dict`."""
        return {
            "class": self.fault_class,
            "time": round_ms(self.ts),
            "node": self.node,
            "kind": self.kind,
            "detector": self.detector,
            "detail": self.detail,
            "exit_code": self.exit_code,
            "recovery": self.recovery,
            "resolution": self.resolution,
            "lost_steps": self.lost_steps,
            "recomputed_steps": self.recomputed_steps,
            "fallback": self.fallback,
            "held_s": self.held_s,
            "phases": self.phases.as_dict(),
        }


@dataclass(frozen=True)
class SpareFault:
    """A spare that failed on standby (no progress lost)."""

    ts: float
    node: str
    detector: str
    detail: str

    def as_dict(self) -> dict[str, Any]:
        """The spare fault's JSON form, the time rounded to milliseconds."""
        return {
            "time": round_ms(self.ts),
            "node": self.node,
            "detector": self.detector,
            "detail": self.detail,
        }


@dataclass(frozen=True)
class JobReport:
    """The faults of one job's event log."""

    job: str
    source: str
    faults: tuple[FaultRecord, ...]
    spare_faults: tuple[SpareFault, ...]


# --- analysis -----------------------------------------------------------------


@dataclass(frozen=True)
class _Cause:
    """One fault as the log shows it: a detection, or a drain the job acted on."""

    fault_class: str
    node: str
    #: the detection; a drain's migration_started or drain_deferred
    event: Event
    #: the detected mark: the detection; a drain's drain_seen or health_warning (None: not in the log)
    mark: Event | None
    reason: str = ""


@dataclass
class _Recovery:
    """What the log says of one recovery, while it is read."""

    index: int
    causes: list[_Cause] = field(default_factory=list)
    #: the epochs of its migration_started events (a chain has several)
    epochs: set[int] = field(default_factory=set)
    started: Event | None = None
    rebuilt: Event | None = None
    agreement: Event | None = None
    transfer: Event | None = None
    first_step: Event | None = None
    done: Event | None = None
    restarted: Event | None = None
    failed: Event | None = None
    deferred: Event | None = None

    def resolution(self) -> str | None:
        """Deferred; migration_done's resolution; a checkpoint restart; fatal if the job failed."""
        if self.deferred is not None:
            return "deferred"
        if self.done is not None and self.done.fields.get("resolution") is not None:
            return str(self.done.fields["resolution"])
        if self.restarted is not None and self.restarted.fields.get("from_checkpoint"):
            return "checkpoint"
        return "fatal" if self.failed is not None else None

    def steps(self, key: str) -> int | None:
        """A step count migration_done reports (``lost_steps``, ``recomputed_steps``), or None.

        A deferred drain loses and recomputes nothing: 0.
        """
        if self.deferred is not None:
            return 0
        value = None if self.done is None else self.done.fields.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass
class _Reader:
    """The state kept while the log is read in order."""

    recoveries: list[_Recovery] = field(default_factory=list)
    open: _Recovery | None = None
    spares: set[str] = field(default_factory=set)
    failed_nodes: set[str] = field(default_factory=set)
    spare_faults: dict[str, SpareFault] = field(default_factory=dict)
    #: node -> its first health_warning not yet followed by a drain
    warnings: dict[str, Event] = field(default_factory=dict)
    #: node -> its drain_seen not yet acted on, and the health_warning before it
    drains: dict[str, tuple[Event, Event | None]] = field(default_factory=dict)

    def feed(self, event: Event) -> None:
        """Take the next event of the log."""
        if is_detection(event):
            self._detection(event)
        elif event.kind in _MIGRATION_SLOTS or event.kind == ev.MIGRATION_DONE:
            self._migration_event(event)
        elif event.kind in _DRAIN_KINDS:
            self._drain_event(event)
        else:
            self._other_event(event)
        if event.kind in CLOSING_KINDS:
            self.open = None

    def _detection(self, event: Event) -> None:
        node = str(event.fields.get("node", ""))
        if self.role_of(event) == NodeRole.SPARE:
            self.spare_faults.setdefault(node, _spare_fault(event, event.kind))
            return
        if node in self.failed_nodes:  # the same fault, seen again
            return
        self.failed_nodes.add(node)
        self._opened().causes.append(_Cause("unplanned", node, event, mark=event))

    def _drain_event(self, event: Event) -> None:
        """A health warning, a drain seen, and what the job did with the drain."""
        node = str(event.fields.get("node", ""))
        if event.kind == ev.HEALTH_WARNING:
            self.warnings.setdefault(node, event)
        elif event.kind == ev.DRAIN_SEEN:
            self.drains[node] = (event, self.warnings.pop(node, None))
        elif event.kind == ev.DRAIN_DEFERRED:
            recovery = _Recovery(index=len(self.recoveries) + 1, deferred=event)
            self.recoveries.append(recovery)  # nothing to recover: it never opens
            recovery.causes.append(self._drain_cause(node, event))

    def _planned_migration(self, event: Event) -> None:
        """A drain moved to a spare: its fault opens (or joins) the recovery; its node leaves."""
        recovery = self._opened()
        for node in event.fields.get("failed") or ():
            self.failed_nodes.add(str(node))
            recovery.causes.append(self._drain_cause(str(node), event))

    def _drain_cause(self, node: str, acted: Event) -> _Cause:
        """The fault of a drain the job acted on (``acted``), with its class and detected mark."""
        drain = self.drains.pop(node, None)
        unclaimed = self.warnings.pop(node, None)  # after the drain_seen, or before a drain not in the log
        seen, warning = drain if drain is not None else (None, unclaimed)
        reason = str(acted.fields.get("reason") or (seen.fields.get("reason") if seen else None) or "")
        pre_emptive = is_pre_emptive_drain(reason) or warning is not None
        return _Cause(
            "pre-emptive" if pre_emptive else "planned", node, acted, mark=warning or seen, reason=reason
        )

    def _opened(self) -> _Recovery:
        """The open recovery; a new one if none is open."""
        if self.open is None:
            self.open = _Recovery(index=len(self.recoveries) + 1)
            self.recoveries.append(self.open)
        return self.open

    def _migration_event(self, event: Event) -> None:
        target = self._recovery_of_epoch(event.epoch) or self.open
        if target is None:
            return
        slot = _MIGRATION_SLOTS.get(event.kind, "done")
        keep_last = event.kind in (ev.GROUP_REBUILT, ev.TRANSFER_DONE)
        if keep_last or getattr(target, slot) is None:
            setattr(target, slot, event)

    def _other_event(self, event: Event) -> None:
        """Membership changes (who is a spare, who rejoined), restarts and the job's failure."""
        fields = event.fields
        if event.kind == ev.STARTED:
            self.spares = {str(n) for n in fields.get("spares") or ()}
        elif event.kind == ev.MIGRATION_STARTED:
            self.spares -= {str(n) for n in fields.get("spares") or ()}
            chained = fields.get("chained_from")
            if isinstance(chained, int) and not isinstance(chained, bool):
                self._continue(chained)
            if fields.get("mode") == "planned":
                self._planned_migration(event)
            if self.open is not None:
                self.open.epochs.add(event.epoch)
                if self.open.started is None:
                    self.open.started = event
        elif event.kind in (ev.SPARE_PROMOTED, ev.WORKER_UP):
            self.failed_nodes.discard(str(fields.get("node")))  # it is (back) in the job
            if event.kind == ev.SPARE_PROMOTED:
                self.spares.discard(str(fields.get("node")))
        elif event.kind == ev.SPARE_LOST:  # stays in self.spares: a late echo is still a spare's
            node = str(fields.get("node", ""))
            self.spare_faults.setdefault(node, _spare_fault(event, ev.SPARE_LOST))
        elif event.kind == ev.RESTARTED and self.open is not None:
            self.open.restarted = event
        elif event.kind == ev.RESTARTED:  # a late restart of a migration that fell back
            target = self._recovery_of_epoch(event.epoch)
            if target is not None and target.restarted is None:
                target.restarted = event
        elif event.kind == ev.FAILED and self.open is not None:
            self.open.failed = event

    def _continue(self, epoch: int) -> None:
        """A recovery that continues the one of ``epoch``: that one opens again, and the faults
        of a recovery opened since (by detections only) join it."""
        chain = self._recovery_of_epoch(epoch)
        if chain is None or chain is self.open:
            return
        if self.open is not None:
            if self.open.started is not None:  # a recovery of its own already: not this chain's
                return
            chain.causes.extend(self.open.causes)
            self.recoveries.remove(self.open)
        self.open = chain

    def _recovery_of_epoch(self, epoch: int) -> _Recovery | None:
        for recovery in reversed(self.recoveries):
            if epoch in recovery.epochs:
                return recovery
        return None

    def role_of(self, event: Event) -> str:
        role = event.fields.get("role")
        if role is not None:
            return str(role)
        return NodeRole.SPARE if event.fields.get("node") in self.spares else NodeRole.ACTIVE


#: Migration kind -> the _Recovery attribute it fills.
_MIGRATION_SLOTS: Mapping[str, str] = {
    ev.GROUP_REBUILT: "rebuilt",
    ev.AGREEMENT: "agreement",
    ev.TRANSFER_DONE: "transfer",
    ev.FIRST_STEP: "first_step",
}
#: Events of a drain before (or instead of) its migration.
_DRAIN_KINDS = frozenset({ev.HEALTH_WARNING, ev.DRAIN_SEEN, ev.DRAIN_DEFERRED})


def is_detection(event: Event) -> bool:
    """Whether the event reports a failure (a rank's ``step_exited`` with exit code 0 does not)."""
    if event.kind not in DETECTION_KINDS:
        return False
    return not (event.kind == ev.STEP_EXITED and event.fields.get("exit_code") == 0)


def analyse(events: Iterable[Event], source: str = "") -> JobReport:
    """The faults and spare faults of one job's events (in log order); see the module rules."""
    events = list(events)
    reader = _Reader()
    for event in events:
        reader.feed(event)
    faults = [_fault(c, r) for r in reader.recoveries for c in r.causes]
    job = next((e.job for e in events if e.job), "")
    return JobReport(
        job=job,
        source=source,
        faults=tuple(faults),
        spare_faults=tuple(sorted(reader.spare_faults.values(), key=lambda s: s.ts)),
    )


def _spare_fault(event: Event, detector: str) -> SpareFault:
    fields = event.fields
    return SpareFault(
        ts=event.ts,
        node=str(fields.get("node", "")),
        detector=str(fields.get("detector") or detector),
        detail=str(fields.get("detail") or ""),
    )


def _fault(cause: _Cause, recovery: _Recovery) -> FaultRecord:
    fields = cause.event.fields
    exit_code = fields.get("exit_code")
    shown = cause.mark or cause.event
    if cause.fault_class == "unplanned":
        detector, detail = str(fields.get("detector") or cause.event.kind), str(fields.get("detail") or "")
    else:
        detector = "health" if shown.kind == ev.HEALTH_WARNING else "drain"
        detail = cause.reason
        if recovery.deferred is not None and recovery.deferred.fields.get("detail"):
            detail += f" (deferred: {recovery.deferred.fields['detail']})"
    started = recovery.started.fields if recovery.started else {}
    held = started.get("held_s")
    return FaultRecord(
        ts=shown.ts,
        node=cause.node,
        kind=shown.kind,
        detector=detector,
        detail=detail,
        exit_code=exit_code if isinstance(exit_code, int) else None,
        recovery=recovery.index,
        resolution=recovery.resolution(),
        lost_steps=recovery.steps("lost_steps"),
        recomputed_steps=recovery.steps("recomputed_steps"),
        phases=_phases(cause, recovery),
        fault_class=cause.fault_class,
        fallback=str(started.get("fallback") or "") or None,
        held_s=round_ms(held) if isinstance(held, (int, float)) else None,
    )


def _phases(cause: _Cause, recovery: _Recovery) -> Phases:
    """Consecutive intervals last heartbeat -> detected -> ... -> first_step (a drain has no heartbeat)."""
    heartbeat = last_heartbeat(recovery.started, cause.node) if cause.fault_class == "unplanned" else None
    ends = (recovery.started, recovery.rebuilt, recovery.agreement, recovery.transfer, recovery.first_step)
    return split_phases(heartbeat, cause.mark, ends)
