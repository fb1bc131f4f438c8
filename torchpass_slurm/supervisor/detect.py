"""Detectors: step exits, heartbeats, Slurm node states, rank reports and the clock, as faults.

:meth:`Detectors.detect` runs once per pass of the supervisor's loop and
returns the faults of one detection, or nothing. Evidence is weighed by how
conclusive it is (each fault says which, :class:`~torchpass_slurm.faults.Evidence`):

- **conclusive, at once**: a step that exited with an error while every
  other active rank runs the elastic loop. Elastic ranks never exit because a
  peer died (they wait for the new epoch), so the exit is the node's own
  process dying;
- **confirmed silence, at once**: a step silent past ``silence_threshold``
  (about 1 s at the default 4 Hz heartbeats) whose loss a second,
  independent signal confirms: a peer's failed collective named the node's
  address, or the node's slurmd no longer accepts a TCP connection
  (:mod:`.probe`, started as soon as the node goes silent);
- **ambiguous, settled**: a step exit in a job whose ranks do not all run
  the elastic loop (its peers' steps exit too when one rank dies), or a
  failed collective that names nobody silent yet. They open a settle window
  of ``fault_settle`` seconds (the loop goes on); confirmed evidence ends it
  early, and at its end the verdict blames the steps silent for the whole
  window, else the step that exited; a failed collective with nobody to
  blame is returned as itself (the planner regroups the same ranks);
- **no progress** (``supervisor/hang.py``): the job's highest step has not
  moved for max(``hang_floor``, ``hang_factor`` x its median step time) while
  every rank computes or synchronises a step; the ranks behind are blamed:
  the silent ones (``heartbeat_lost``), else those still computing the step
  their peers wait in (``rank_hung``, a rank that heartbeats but is stuck);
- **timeout**: silence past ``heartbeat_timeout`` with nothing to confirm it
  (a frozen or hung process on a node that still answers), a step never up
  within ``startup_timeout``;
- **Slurm** (at most every ``slurm_poll_interval``): a node DOWN, FAIL,
  NOT_RESPONDING, or gone from the job.

Drains are not faults of the moment: each drain on a node of the job is
recorded once (``drain_seen``) and queued in :attr:`Detectors.drains` until the
loop can move the node at a step boundary.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass

from torchpass_slurm.config import SupervisorConfig
from torchpass_slurm.control.reports import HealthWarning
from torchpass_slurm.errors import SlurmError
from torchpass_slurm.faults import Detector, Evidence, Fault, Resolution
from torchpass_slurm.rundir import events as ev
from torchpass_slurm.slurm.models import Node
from torchpass_slurm.supervisor import hang
from torchpass_slurm.supervisor.context import JobContext
from torchpass_slurm.supervisor.state import RunState
from torchpass_slurm.supervisor.workers import WorkerState, WorkerStep

__all__ = ["Detectors", "dead_rank", "stuck_rank", "torn_too_long"]

logger = logging.getLogger(__name__)

#: A peer's address in torch's error text: gloo writes ``[10.1.2.3]:5000``, NCCL ``10.1.2.3<5000>``.
_PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+|\b(\d{1,3}(?:\.\d{1,3}){3})<\d+>")
#: The silence checks run at most this often (seconds): they walk every step, and a loop
#: pass comes with every batch of messages, hundreds a second at scale.
SILENCE_CHECK_S = 0.1
#: A peer's report counts for a node that went silent up to this long after it (seconds):
#: the report may come a moment before the node's last heartbeat is overdue.
_NAMED_SLACK_S = 1.0


@dataclass(frozen=True)
class _Settle:
    """An open settle window: the suspicion that opened it, and when it closes (monotonic)."""

    first: Fault
    deadline: float


class Detectors:
    """Turns what the supervisor observes into faults; see the module docstring."""

    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx
        self.job = ctx.job
        #: drains seen on the job's nodes, waiting for a step boundary
        self.drains: list[Fault] = []
        #: Slurm's last word on each watched node: usable or not
        self.usable: dict[str, bool] = {}
        self._drains_seen: set[str] = set()
        #: nodes a peer's failed collective named: node -> (when, what the peer said)
        self._named: dict[str, tuple[float, str]] = {}
        self._reported: Fault | None = None
        self._settle: _Settle | None = None
        self._next_slurm_poll = 0.0
        self._next_silence_check = 0.0
        #: no progress, counted only while the job is steady and every rank computes or syncs
        self.hang = hang.HangWatch()

    @property
    def settling(self) -> bool:
        """A settle window is open: the loop must not start other work (drains, the end)."""
        return self._settle is not None

    # -- signals that arrive as messages --------------------------------------
    def collective_failed(self, node: str, rank: object, error: str) -> None:
        """A rank of ``node`` (of the current epoch) reports a failed collective."""
        detail = f"rank {rank} on {node}: a collective failed ({error[:120]})"
        for peer in self._peers_named(error):
            if peer != node:
                self._named[peer] = (self.ctx.clock.time(), detail)
        if self._reported is None and self._settle is None:
            self._reported = Fault(node, Detector.COLLECTIVE_FAILED, detail)

    def health_warning(self, node: str, warning: HealthWarning) -> Fault | None:
        """``node``'s health agent warns: the fault; None for a node that is not active.

        A warning (pre-emptive: the node still works) drains it, logged as ``health_warning``.
        A GPU signal that takes the node now (``move_now``) is an unplanned loss of the node
        (``gpu_failed``, logged when its plan records the loss): its step is stopped and its
        state comes from a replica, as for a node that died, without waiting for a step boundary.
        """
        if node not in self.job.membership.active:
            return None
        detail = f"{warning.status}: {warning.summary}"
        if warning.move_now:
            return Fault(node, Detector.GPU_FAILED, detail, evidence=Evidence.HEALTH)
        self.ctx.events.append(ev.HEALTH_WARNING, node=node, status=warning.status, summary=warning.summary)
        return Fault(node, Detector.HEALTH_WARNING, detail)

    def _peers_named(self, error: str) -> list[str]:
        if self.ctx.probe is None:
            return []
        found = (self.ctx.probe.node_of_address(a or b) for a, b in _PEER_ADDRESS.findall(error))
        return [n for n in found if n is not None]

    # -- one detection ----------------------------------------------------------
    def detect(self) -> list[Fault]:
        """The faults of one detection (at once when conclusive, else after settling), or []."""
        if self.job.state != RunState.RUNNING or self.job.migration is not None or self._settle is not None:
            self.hang.unsteady(self.ctx.clock.monotonic())
        exited = self._step_exit()
        if exited is not None and self._exit_is_conclusive(exited.node):
            return self._judged([dataclasses.replace(exited, evidence=Evidence.CONCLUSIVE)])
        silence_due = self.ctx.clock.monotonic() >= self._next_silence_check
        if silence_due:
            self._next_silence_check = self.ctx.clock.monotonic() + SILENCE_CHECK_S
        confirmed = self._confirmed_silence() if silence_due else []
        if confirmed:
            return self._judged(confirmed)
        if self._settle is not None:
            if self.ctx.clock.monotonic() < self._settle.deadline:
                return []
            first = self._settle.first
            return self._judged(self._verdict(first), first)
        reported, self._reported = self._reported, None
        suspicion = exited or reported
        if suspicion is not None:
            self._settle = _Settle(suspicion, self.ctx.clock.monotonic() + self.ctx.config.fault_settle)
            return []
        if silence_due:
            stalled = self._no_progress()
            if stalled:
                return stalled
        fault = (self._silence() if silence_due else None) or self._stalled_recovery() or self._watch_slurm()
        return [fault] if fault is not None else []

    def _no_progress(self) -> list[Fault]:
        """The ranks behind a job whose step has not moved for its hang threshold."""
        return self.hang.check(self.job, self.ctx.config, self.ctx.clock)

    def _stalled_recovery(self) -> Fault | None:
        """A live, planned or regroup recovery past ``recovery_timeout`` without its first step."""
        migration = self.job.migration
        if migration is None or migration.resolution not in (Resolution.LIVE, Resolution.REGROUP):
            return None
        if self.job.holding is not None:  # a loss during the recovery waits for a spare
            return None
        waited = self.ctx.clock.time() - (migration.epoch_started or migration.started)
        if waited <= self.ctx.config.recovery_timeout:
            return None
        node = self.job.membership.node_of_rank(0)
        return Fault(
            node,
            Detector.RECOVERY_STALLED,
            f"the recovery to epoch {migration.epoch} has not reached its first step after {waited:.0f} s",
            evidence=Evidence.TIMEOUT,
        )

    def _judged(self, blamed: list[Fault], first: Fault | None = None) -> list[Fault]:
        """Close any open suspicion: the faults of this detection, with the failed collective
        that opened it (reports gathered meanwhile belong to this fault)."""
        first = first or (self._settle.first if self._settle is not None else self._reported)
        self._settle, self._reported = None, None
        self._named.clear()
        if first is not None and first.detector == Detector.COLLECTIVE_FAILED and first not in blamed:
            blamed = [*blamed, first]
        return blamed

    def _exit_is_conclusive(self, node: str) -> bool:
        """A spare's exit, or an active step's while every other active rank is elastic."""
        m = self.job.membership
        if node in m.spares:
            return True
        others = [self.job.steps[n] for n in m.active if n != node and n in self.job.steps]
        return all(s.live and s.state == WorkerState.RUNNING for s in others)

    def _confirmed_silence(self) -> list[Fault]:
        """Steps silent past ``silence_threshold`` whose loss a second signal confirms; a probe
        is started for the others."""
        now, faults = self.job.silence_clock(self.ctx.clock.time()), []
        threshold = self.ctx.config.silence_threshold
        for node, step in self._watched():
            silent, peers = step.lost_for(now), True
            if silent is None or silent <= threshold:
                if not step.tearing:
                    continue  # no task tearing its group down: it would count the same tasks
                # silent only through tasks tearing their group down: alive a moment ago, and a
                # peer's error names them because they shut their sockets first; only the probe
                silent, peers = step.lost_for(now, tearing=True), False
                if silent is None or silent <= threshold:
                    continue
            else:
                dead = dead_rank(step, now, self.ctx.config)
                if dead is not None:
                    faults.append(dead)
                    continue
            evidence = self._second_signal(node, now - silent, peers=peers)
            if evidence is not None:
                kind, why = evidence
                faults.append(
                    Fault(
                        node,
                        Detector.HEARTBEAT_LOST,
                        f"{node} silent for {silent:.1f} s; {why}",
                        evidence=kind,
                    )
                )
        return faults

    def _second_signal(
        self, node: str, silent_since: float, *, peers: bool = True
    ) -> tuple[Evidence, str] | None:
        named = self._named.get(node) if peers else None
        if named is not None and named[0] >= silent_since - _NAMED_SLACK_S:
            return Evidence.PEER_REPORT, f"named by {named[1]}"
        if self.ctx.probe is None:
            return None
        result = self.ctx.probe.verdict(node, since=silent_since)
        if result is None:
            self.ctx.probe.start(node)
            return None
        if not result.reachable:
            return Evidence.PROBE, f"its slurmd: {result.detail}"
        return None

    def _watched(self) -> list[tuple[str, WorkerStep]]:
        """Running and standby steps, not being released: the ones silence can blame."""
        return [
            (n, s)
            for n, s in self.job.steps.items()
            if n not in self.job.releasing and s.state in (WorkerState.RUNNING, WorkerState.STANDBY)
        ]

    def _verdict(self, first: Fault) -> list[Fault]:
        """At the end of the settle window: the nodes silent all along, else the step that exited."""
        job = self.job
        now, window = job.silence_clock(self.ctx.clock.time()), self.ctx.config.fault_settle
        silent = [
            n
            for n in job.membership.active + job.membership.spares
            if job.steps[n].poll() is None and (job.steps[n].lost_for(now) or 0.0) >= window
        ]
        if silent:
            return [
                Fault(
                    n,
                    Detector.HEARTBEAT_LOST,
                    f"{n} went silent ({job.steps[n].lost_for(now):.1f} s) while {first.detail}",
                    evidence=Evidence.SETTLED,
                )
                for n in silent
            ]
        if first.detector == Detector.STEP_EXITED:
            return [dataclasses.replace(first, evidence=Evidence.SETTLED)]
        return [
            dataclasses.replace(self._exit_fault(n, rc), evidence=Evidence.SETTLED)
            for n, s in job.live_steps().items()
            if (rc := s.poll()) not in (None, 0)
        ][:1]

    def _step_exit(self) -> Fault | None:
        """The first step that exited with an error, or a spare's that exited at all (nobody
        told it to: a stopped spare's step is STOPPING, not watched)."""
        for node, step in self.job.live_steps().items():
            rc = step.poll()
            if rc is None or node in self.job.releasing:
                continue
            if rc != 0 or step.state == WorkerState.STANDBY:
                return self._exit_fault(node, rc)
        return None

    @staticmethod
    def _exit_fault(node: str, rc: int) -> Fault:
        return Fault(node, Detector.STEP_EXITED, f"srun step on {node} exited with status {rc}", rc)

    def _silence(self) -> Fault | None:
        """Silence past ``heartbeat_timeout`` that nothing confirmed (a frozen process on a node
        that answers), or a step never up within ``startup_timeout``."""
        now, cfg = self.job.silence_clock(self.ctx.clock.time()), self.ctx.config
        for node, step in self._watched():
            silent = step.lost_for(now)
            if silent is not None and silent > cfg.heartbeat_timeout:
                return Fault(
                    node,
                    Detector.HEARTBEAT_LOST,
                    f"no heartbeat from {node} for {silent:.1f} s (it still answers: hung?)",
                    evidence=Evidence.TIMEOUT,
                )
            hung = stuck_rank(step, now, self.ctx.config) or torn_too_long(step, now, self.ctx.config)
            if hung is not None:
                return hung
        for node, step in self.job.steps.items():
            if node in self.job.releasing:
                continue
            if step.state == WorkerState.STARTING and now - step.started > cfg.startup_timeout:
                return Fault(
                    node,
                    Detector.STARTUP_TIMEOUT,
                    f"{node} did not report within {cfg.startup_timeout:.0f} s",
                    evidence=Evidence.TIMEOUT,
                )
        return None

    def _watch_slurm(self) -> Fault | None:
        """Poll Slurm for the job's nodes, at most every ``slurm_poll_interval`` seconds."""
        now = self.ctx.clock.monotonic()
        if now < self._next_slurm_poll:
            return None
        self._next_slurm_poll = now + self.ctx.config.slurm_poll_interval
        watched = list(self.job.live_steps())
        if not watched:
            return None
        try:
            job_nodes = set(self.ctx.slurm.job(self.job.job_id).nodes)
            nodes = {n.name: n for n in self.ctx.slurm.nodes(watched)}
        except SlurmError as err:  # the watcher must never kill the job
            logger.warning("Slurm watcher: %s", err)
            self.usable.clear()
            return None
        for name in watched:
            node = nodes.get(name)
            self.usable[name] = node is not None and node.is_usable
            if job_nodes and name not in job_nodes:
                return Fault(
                    name,
                    Detector.NODE_GONE,
                    f"Slurm no longer lists {name} in job {self.job.job_id}",
                    evidence=Evidence.SLURM,
                )
            if node is not None:
                fault = self._judge_node(node)
                if fault is not None:
                    return fault
        return None

    def _judge_node(self, node: Node) -> Fault | None:
        if node.is_down or "FAIL" in node.flags or not node.is_responding:
            return Fault(
                node.name,
                Detector.NODE_DOWN,
                f"Slurm reports {node.name} {node.state_text}",
                evidence=Evidence.SLURM,
            )
        if node.is_drain and node.name not in self._drains_seen:
            self._drains_seen.add(node.name)
            self.ctx.events.append(ev.DRAIN_SEEN, node=node.name, reason=node.reason or "")
            self.drains.append(Fault(node.name, Detector.DRAIN, node.reason or ""))
        return None


# -- one node's ranks, with per-node heartbeats ------------------------------------------


def dead_rank(step: WorkerStep, now: float, config: SupervisorConfig) -> Fault | None:
    """A rank silent past ``silence_threshold`` whose process its node's local rank 0 found
    gone, while the node beats: the node's word is the second signal."""
    gone = [(s, now - step.heartbeats[s]) for s in sorted(step.gone) if s in step.heartbeats]
    gone = [(s, silent) for s, silent in gone if silent > config.silence_threshold]
    if not gone or (step.relay is not None and step.relay in step.gone):
        return None
    relay_silent = now - step.heartbeats.get(step.relay or "", now)
    if relay_silent > config.silence_threshold:
        return None  # the node itself is silent: judged as a node
    sender, silent = gone[0]
    return Fault(
        step.node,
        Detector.HEARTBEAT_LOST,
        f"{sender} silent for {silent:.1f} s; its process is gone, its node's local rank 0 says",
        evidence=Evidence.LOCAL_REPORT,
    )


def stuck_rank(step: WorkerStep, now: float, config: SupervisorConfig) -> Fault | None:
    """A rank silent while its node beats and its process lives (per-node heartbeats), past
    ``heartbeat_timeout``, or ``teardown_timeout`` when its last word was a failed
    collective: that rank is hung, not its node silent. Once the node's local rank 0 is
    itself silent past ``silence_threshold`` its entries stopped with it: the node is judged
    by its own silence (its ranks' entries, a fraction of an interval older than its last
    beat, would otherwise blame one of them a moment before the node's timeout)."""
    relay_silent = now - step.heartbeats.get(step.relay or "", now)
    if relay_silent > config.silence_threshold:
        return None
    bound = min(config.teardown_timeout, config.heartbeat_timeout)
    if not step.heartbeats or now - min(step.heartbeats.values()) <= bound:
        return None  # no task of the step is silent that long (the common case: not sorted)
    for sender, silent, phase in step.stuck(now):
        recovering = sender in step.tearing
        bound = config.teardown_timeout if recovering else config.heartbeat_timeout
        if silent > bound:
            doing = "since its collective failed" if recovering else f"(last seen {phase or 'starting'})"
            return Fault(
                step.node,
                Detector.RANK_HUNG,
                f"{sender} silent for {silent:.1f} s {doing} while its node beats; its process lives: hung?",
                evidence=Evidence.TIMEOUT,
            )
    return None


def torn_too_long(step: WorkerStep, now: float, config: SupervisorConfig) -> Fault | None:
    """A task silent past ``teardown_timeout`` since its failed collective was its last word,
    where the node is silent with it (per-rank beats, or the node's own local rank 0): its
    teardown never ended."""
    torn = step.tearing_for(now)
    if torn is None or torn[1] <= config.teardown_timeout:
        return None
    sender, silent = torn
    return Fault(
        step.node,
        Detector.RANK_HUNG,
        f"{sender} silent for {silent:.1f} s since its collective failed: its teardown did not end",
        evidence=Evidence.TIMEOUT,
    )
