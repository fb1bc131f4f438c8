"""Detectors: step exits, heartbeats, Slurm node states, rank reports and the clock, as faults.

:meth:`Detectors.detect` runs once per pass of the supervisor's loop and
returns the faults of one detection, or nothing. The first signal wins, in
this order: a step that exited with an error, a rank's failed collective,
silence (heartbeats or hello overdue), Slurm (a node DOWN / FAIL /
NOT_RESPONDING or gone from the job; at most every ``slurm_poll_interval``).

A step's error exit and a failed collective are *suspicions*: when one node
dies, the ranks on the others fail in their next collective and their steps
exit too, and blaming the first exit would blame a healthy node. So they
open a settle window of ``fault_settle`` seconds (the loop goes on: messages,
promotions, transfers), and at its end the verdict blames the nodes whose
steps still run but went silent; if none did, the step that exited (a crashed
rank process). A failed collective with nobody to blame is returned as
itself: the planner regroups the same ranks.

Drains are not faults of the moment: each drain on a node of the job is
recorded once (``drain_seen``) and queued in :attr:`Detectors.drains` until the
loop can move the node at a step boundary.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torchpass_slurm import events as ev
from torchpass_slurm.config import SupervisorConfig
from torchpass_slurm.errors import SlurmError
from torchpass_slurm.faults import Detector, Fault
from torchpass_slurm.slurm import SlurmBackend
from torchpass_slurm.slurm.models import Node
from torchpass_slurm.supervisor.state import Clock, JobState
from torchpass_slurm.supervisor.workers import WorkerState

__all__ = ["Detectors"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Settle:
    """An open settle window: the suspicion that opened it, and when it closes (monotonic)."""

    first: Fault
    deadline: float


class Detectors:
    """Turns what the supervisor observes into faults; see the module docstring."""

    def __init__(
        self,
        job: JobState,
        *,
        slurm: SlurmBackend,
        config: SupervisorConfig,
        clock: Clock,
        events: ev.EventLog,
    ) -> None:
        self.job = job
        self.slurm = slurm
        self.config = config
        self.clock = clock
        self.events = events
        #: drains seen on the job's nodes, waiting for a step boundary
        self.drains: list[Fault] = []
        #: Slurm's last word on each watched node: usable or not
        self.usable: dict[str, bool] = {}
        self._drains_seen: set[str] = set()
        self._reported: Fault | None = None
        self._settle: _Settle | None = None
        self._next_slurm_poll = 0.0

    @property
    def settling(self) -> bool:
        """A settle window is open: the loop must not start other work (drains, the end)."""
        return self._settle is not None

    # -- signals that arrive as messages --------------------------------------
    def collective_failed(self, node: str, rank: object, error: str) -> None:
        """A rank of ``node`` (of its current epoch) reports a failed collective."""
        if self._reported is None and self._settle is None:
            self._reported = Fault(
                node,
                Detector.COLLECTIVE_FAILED,
                f"rank {rank} on {node}: a collective failed ({error[:120]})",
            )

    # -- one detection ----------------------------------------------------------
    def detect(self) -> list[Fault]:
        """The faults of one detection (judged, possibly after a settle window), or []."""
        if self._settle is not None:
            if self.clock.monotonic() < self._settle.deadline:
                return []
            first, self._settle = self._settle.first, None
            self._reported = None  # reports gathered while settling belong to this fault
            return self._verdict(first)
        reported, self._reported = self._reported, None
        fault = self._step_exit() or reported or self._silence() or self._watch_slurm()
        if fault is None:
            return []
        if fault.detector in (Detector.STEP_EXITED, Detector.COLLECTIVE_FAILED):
            self._settle = _Settle(fault, self.clock.monotonic() + self.config.fault_settle)
            return []
        return [fault]

    def _verdict(self, first: Fault) -> list[Fault]:
        """At the end of the settle window: the silent nodes, else the step that exited."""
        job, now = self.job, self.clock.time()
        silent = [
            n
            for n in job.membership.active + job.membership.spares
            if job.steps[n].poll() is None
            and (job.steps[n].silent_for(now) or 0.0) > self.config.silence_threshold
        ]
        if silent:
            blamed = [
                Fault(
                    n,
                    Detector.HEARTBEAT_LOST,
                    f"{n} went silent ({job.steps[n].silent_for(now):.0f} s) while {first.detail}",
                )
                for n in silent
            ]
        elif first.detector == Detector.STEP_EXITED:
            blamed = [first]
        else:
            blamed = [
                self._exit_fault(n, rc)
                for n, s in job.live_steps().items()
                if (rc := s.poll()) not in (None, 0)
            ][:1]
        return blamed + ([first] if first.detector == Detector.COLLECTIVE_FAILED else [])

    def _step_exit(self) -> Fault | None:
        for node, step in self.job.live_steps().items():
            rc = step.poll()
            if rc is not None and rc != 0 and node not in self.job.releasing:
                return self._exit_fault(node, rc)
        return None

    @staticmethod
    def _exit_fault(node: str, rc: int) -> Fault:
        return Fault(node, Detector.STEP_EXITED, f"srun step on {node} exited with status {rc}", rc)

    def _silence(self) -> Fault | None:
        now, cfg = self.clock.time(), self.config
        for node, step in self.job.steps.items():
            if node in self.job.releasing:
                continue
            if step.state in (WorkerState.RUNNING, WorkerState.STANDBY):
                silent = step.silent_for(now)
                if silent is not None and silent > cfg.heartbeat_timeout:
                    return Fault(
                        node, Detector.HEARTBEAT_LOST, f"no heartbeat from {node} for {silent:.0f} s"
                    )
            elif step.state == WorkerState.STARTING and now - step.started > cfg.startup_timeout:
                return Fault(
                    node,
                    Detector.STARTUP_TIMEOUT,
                    f"{node} did not report within {cfg.startup_timeout:.0f} s",
                )
        return None

    def _watch_slurm(self) -> Fault | None:
        """Poll Slurm for the job's nodes, at most every ``slurm_poll_interval`` seconds."""
        now = self.clock.monotonic()
        if now < self._next_slurm_poll:
            return None
        self._next_slurm_poll = now + self.config.slurm_poll_interval
        watched = list(self.job.live_steps())
        if not watched:
            return None
        try:
            job_nodes = set(self.slurm.job(self.job.job_id).nodes)
            nodes = {n.name: n for n in self.slurm.nodes(watched)}
        except SlurmError as err:  # the watcher must never kill the job
            logger.warning("Slurm watcher: %s", err)
            self.usable.clear()
            return None
        for name in watched:
            node = nodes.get(name)
            self.usable[name] = node is not None and node.is_usable
            if job_nodes and name not in job_nodes:
                return Fault(
                    name, Detector.NODE_GONE, f"Slurm no longer lists {name} in job {self.job.job_id}"
                )
            if node is not None:
                fault = self._judge_node(node)
                if fault is not None:
                    return fault
        return None

    def _judge_node(self, node: Node) -> Fault | None:
        if node.is_down or "FAIL" in node.flags or not node.is_responding:
            return Fault(node.name, Detector.NODE_DOWN, f"Slurm reports {node.name} {node.state_text}")
        if node.is_drain and node.name not in self._drains_seen:
            self._drains_seen.add(node.name)
            self.events.append(ev.DRAIN_SEEN, node=node.name, reason=node.reason or "")
            self.drains.append(Fault(node.name, Detector.DRAIN, node.reason or ""))
        return None
