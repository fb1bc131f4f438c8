"""A hang is known by lack of progress, not by lack of liveness: the pure judgment.

The detectors (:mod:`.detect`) ask :class:`HangWatch` at every silence
check; it calls :func:`behind` once the job's highest step has not moved
for :func:`threshold` seconds, a multiple of its median step time
(:mod:`.progress`) with a floor, with every active rank's last heartbeat:
its committed step and its phase (:mod:`torchpass_slurm.phase`).
In a data-parallel step every rank waits for every other in the gradients'
all-reduce, so when nothing moves, the ranks to blame are the ones not
waiting:

- ranks **silent** past ``silence_threshold`` (a frozen process: SIGSTOP, a
  node gone quiet): their silence alone proves nothing on a loaded host, but
  silence *and* a stalled job does;
- else the ranks that have not reached the all-reduce their peers wait in
  (``sync`` after committing step S): those still in ``compute`` after S,
  and those that have not committed S (stuck in the optimizer step of S).
  That is a rank stuck in Python, in its data loader or in a kernel, whose
  heartbeat thread still runs.

A rank stuck inside its backward looks like its waiting peers (``sync`` at
the same step), and one stuck in ``on_commit`` like a slow checkpoint: those
are not judged by progress. No verdict when any rank's last phase is not ``compute`` or ``sync``: in
``on_commit`` (a checkpoint write may take long, and may even hold the GIL
from the heartbeat thread), recovering (a recovery has its own timeout), or
outside the elastic loop; nor when every rank is silent (then the supervisor
is the one not hearing). The silence timeout still applies there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torchpass_slurm.config import SupervisorConfig
from torchpass_slurm.faults import Detector, Evidence, Fault
from torchpass_slurm.phase import JUDGED, Phase
from torchpass_slurm.supervisor.state import Clock, JobState
from torchpass_slurm.supervisor.workers import WorkerState

__all__ = ["RankView", "HangWatch", "threshold", "behind"]


@dataclass(frozen=True)
class RankView:
    """One task of an active step, as its last heartbeat left it."""

    node: str
    sender: str
    step: int | None
    phase: str
    silent: bool


def threshold(step_seconds: float | None, factor: float, floor: float) -> float | None:
    """How long the job may make no progress: max(``floor``, ``factor`` x one step); None
    while the pace is not known yet (before the second advance)."""
    if step_seconds is None:
        return None
    return max(floor, factor * step_seconds)


def behind(ranks: Sequence[RankView]) -> tuple[Detector, list[RankView]] | None:
    """The detector and the ranks to blame in a job that made no progress, or None."""
    if not ranks or any(r.phase not in JUDGED for r in ranks):
        return None
    silent = [r for r in ranks if r.silent]
    if silent:
        if len(silent) == len(ranks):
            return None
        return Detector.HEARTBEAT_LOST, silent
    waits = [r.step for r in ranks if r.phase == Phase.SYNC and r.step is not None]
    if not waits:
        return None
    waited = max(waits)  # the peers wait in the all-reduce of the step after this one
    stuck = [
        r
        for r in ranks
        if r.step is not None and (r.step < waited or (r.step == waited and r.phase == Phase.COMPUTE))
    ]
    return (Detector.RANK_HUNG, stuck) if stuck else None


class HangWatch:
    """When the job's lack of progress started to count, and the verdict once it is due.

    The time without progress counts only while every active rank is in
    ``compute`` or ``sync``: from the last advance of the job's highest step,
    from the end of a recovery or settle window (:meth:`unsteady`), or from
    the last check that found a rank in another phase, whichever is latest.
    So a checkpoint in ``on_commit`` never counts, even once it is over and
    the ranks' next step has begun at different times.
    """

    def __init__(self) -> None:
        self.since = 0.0

    def unsteady(self, now: float) -> None:
        """The job is launching, recovering or settling at ``now`` (monotonic)."""
        self.since = now

    def check(self, job: JobState, config: SupervisorConfig, clock: Clock) -> list[Fault]:
        """The faults of a job without progress for its threshold, or [].

        It runs with every silence check (ten times a second); the ranks' views are built
        only once a verdict is due (a job that progresses never needs them).
        """
        now = clock.monotonic()
        if not judged(job):
            self.since = now
            return []
        limit = threshold(job.progress.step_seconds, config.hang_factor, config.hang_floor)
        last = job.progress.last_advance
        if limit is None or last is None:
            return []
        quiet = now - max(last, self.since)
        verdict = behind(views(job, clock.time(), config.silence_threshold)) if quiet > limit else None
        if verdict is None:
            return []
        detector, blamed = verdict
        why = f"no step progress for {quiet:.1f} s (threshold {limit:.1f} s)"
        faults: dict[str, Fault] = {}
        for r in blamed:
            if detector == Detector.HEARTBEAT_LOST:
                silent = job.steps[r.node].silent_for(clock.time()) or 0.0
                detail = f"{r.node} silent for {silent:.1f} s; {why}"
            else:
                detail = f"{r.sender} still computing after step {r.step} while its peers wait; {why}"
            faults.setdefault(r.node, Fault(r.node, detector, detail, evidence=Evidence.PROGRESS))
        return list(faults.values())


def judged(job: JobState) -> bool:
    """Whether the job is judged by its progress now: :func:`views` would give ranks, every
    one of them in a phase of :data:`~torchpass_slurm.phase.JUDGED` (checked without building them)."""
    heard = False
    for node in job.membership.active:
        step = job.steps.get(node)
        if step is None or step.state != WorkerState.RUNNING or node in job.releasing:
            return False
        phases = step.phases
        for sender in step.heartbeats:
            if phases.get(sender, _NO_PHASE)[1] not in JUDGED:
                return False
            heard = True
    return heard


_NO_PHASE: tuple[int | None, str] = (None, "")


def views(job: JobState, now: float, silence_threshold: float) -> list[RankView]:
    """Every task of the job's active steps as its last heartbeat left it; [] unless every
    active step is running (and none is handing over after a drain)."""
    out = []
    for node in job.membership.active:
        step = job.steps.get(node)
        if step is None or step.state != WorkerState.RUNNING or node in job.releasing:
            return []
        for sender, heard in step.heartbeats.items():
            at, phase = step.phases.get(sender, (None, ""))
            out.append(RankView(node, sender, at, phase, now - heard > silence_threshold))
    return out
