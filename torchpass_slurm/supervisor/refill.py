"""The spare pool refills: when a spare was used, Slurm is asked for a node to replace it.

A job reserves S spares. Each live migration promotes one, a spare that dies
on standby is dropped, and without refills the job survives S node losses and
no more. :class:`SparePool` keeps the pool at S for the job's whole life:

* **When.** Every loop pass, while the job runs: when the spares held, the
  nodes being asked for and the nodes granted but not joined yet are fewer
  than S, one more node is asked for, one request at a time (two in flight
  were both given the same node once it came free, and merging it twice took
  a CPU off the job: measured on Slurm 24.11). After a refusal the next
  request waits
  :attr:`~torchpass_slurm.config.SupervisorConfig.refill_retry` seconds.
* **How.** Job expansion (``SlurmBackend.expand_job``): a one-node allocation
  that depends on ``expand:JOB`` is merged into the running job, on a thread
  of the pool's own (``salloc`` waits up to ``refill_wait`` s for a node; the
  loop never waits on it). Slurm must permit it
  (``SchedulerParameters=permit_job_expansion``). A prolog that runs at
  allocation (``PrologFlags=Alloc``) is never run for the merged node on
  Slurm 24.11, whose first step then fails: with that flag the pool does not
  ask, and says why once. Nor for a job of more than one task per node: its
  step on a merged node stayed pending until the job ended, with or without
  ``--exclusive`` on the request (Slurm 24.11; not understood yet).
* **Joining.** A granted node joins as a spare between recoveries (never
  while one is in flight, whose plan fixed the membership), or while the job
  holds its step for one (``supervisor/hold.py``: the pool then asks for a
  node per held loss on top of its target): the loop takes it
  with :meth:`ready` and launches its standby step. The prolog runs at the
  node's first step.
* **A lost node comes back only once it is alive.** Slurm calls a dead node
  idle until it has missed ``SlurmdTimeout`` of pings, and grants it: a node
  powered off 2 s earlier was granted at once, and slurmctld took 30 to 56 s
  (``SlurmdTimeout`` 30 s) to set a powered-off node down. A dead node merged
  into the job is worse than a failed standby: when Slurm sets it down it
  leaves the job, and once powered on again it stays ALLOCATED with no job on
  it until ``scontrol reconfigure`` (Slurm 24.11, measured). So a node the job
  lost is asked back only once its slurmd has started again since the loss
  (repaired: ``scontrol show node``'s ``SlurmdStartTime``), or its slurmd
  accepts a TCP connection when the pool asks (the node never went down: a
  rank that hung, a process killed; ``supervisor/probe.py``), or
  :data:`UNNOTICED_FACTOR` times ``SlurmdTimeout`` after the loss, when Slurm
  has set it down if it is dead. A hung rank's node waited 55 s for that
  before the probe (trixie dev cluster, SlurmdTimeout 30 s).
* **A lost node Slurm would not release is taken back in place.** Slurm 22.05
  without accounting refuses every shrink ("the DB index is being set"): the
  lost node stays in the job's allocation, and requests, which exclude the
  job's nodes, can never have it. When it never went down (its slurmd, not
  restarted since the loss, accepts the probe: a rank that hung, a process
  killed) it joins as a spare without a request (``spare_added`` with
  ``in_job``). A node powered off and on again is not: Slurm still counted
  its lost step on it, and a new step there stayed pending.

A node that outlived its rank's fault (``supervisor/plan.py``, ``outlived``:
a crashed or hung process on a node Slurm calls usable) comes back first:
:meth:`SparePool.give_back` holds it until its old step has ended, it counts
toward the pool meanwhile (Slurm is not asked for a node in its place), and
it joins like a granted node.

Every request and outcome is an event: ``spare_requested``, ``spare_added``
(with the seconds from the request, or from the loss for a node given back:
``returned``), ``spare_refused`` (with Slurm's words).
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

from torchpass_slurm.errors import SlurmError
from torchpass_slurm.rundir import events as ev
from torchpass_slurm.slurm.cli_backend import EXPANSION_BLOCKER
from torchpass_slurm.supervisor.context import JobContext
from torchpass_slurm.supervisor.state import Clock, RunState

__all__ = ["SparePool", "Granted", "DEFAULT_SLURMD_TIMEOUT_S"]

#: Slurm's default SlurmdTimeout, used when slurmctld's cannot be read.
DEFAULT_SLURMD_TIMEOUT_S = 300.0
#: How many SlurmdTimeouts a dead node may still look alive to Slurm (1.9 measured).
UNNOTICED_FACTOR = 3

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Granted:
    """A node Slurm merged into the job (or one given back), waiting to join as a spare."""

    node: str
    requested_at: float  # monotonic
    returned: bool = False
    #: a lost node that never left the job's allocation (Slurm would not release it)
    in_job: bool = False


class SparePool:
    """Asks Slurm for nodes until the job holds ``target`` spares again; see the module docstring."""

    def __init__(self, ctx: JobContext, *, target: int) -> None:
        self.ctx = ctx
        self.job = ctx.job
        self.target = target
        #: requests in flight on the pool's thread
        self.asking = 0
        self._granted: list[Granted] = []
        #: lost nodes that outlived their rank's fault, waiting for their old step to end
        self._returning: list[Granted] = []
        #: (requested at, the nodes or None, Slurm's error, whether the cluster rules refills
        #: out, whether the nodes are in the job's allocation already)
        self._outcomes: queue.SimpleQueue[tuple[float, tuple[str, ...] | None, str, bool, bool]] = (
            queue.SimpleQueue()
        )
        self._next_try = 0.0
        self._blocked: str | None = None  # why the pool never asks again (said once)
        self._checked = False  # PrologFlags read (on the pool's thread)
        #: when each node the job lost was first seen lost (monotonic, wall)
        self._lost: dict[str, tuple[float, float]] = {}
        #: Slurm's SlurmdTimeout: how long a dead node may still look idle to it (read once)
        self._slurmd_timeout = DEFAULT_SLURMD_TIMEOUT_S
        self._closing = threading.Event()

    @property
    def granted(self) -> int:
        return len(self._granted)

    @property
    def can_refill(self) -> bool:
        """The pool may still ask Slurm for nodes (a job may hold its step for one)."""
        return self.target > 0 and self._blocked is None and self.job.membership.ntasks_per_node == 1

    def hold_left(self) -> float:
        """How long a plan may still hold the job's step for a spare (``supervisor/hold.py``):
        ``spare_wait`` before a hold, what is left of it during one; 0 when the pool cannot
        refill."""
        if not self.can_refill:
            return 0.0
        if self.job.holding is None:
            return self.ctx.config.spare_wait
        return max(0.0, self.job.holding.until - self.ctx.clock.monotonic())

    def check(self) -> None:
        """Collect what Slurm answered, and ask again while the pool is short (the loop's thread)."""
        self._collect()
        # a held loss keeps its slot until a spare takes it, but its node is as lost: Slurm
        # granted a node powered off 1.5 s earlier to the request a hold made, and merged into
        # the job, its death then cancelled the job (Slurm 24.11, a heterogeneous job)
        holding = self.job.holding.nodes if self.job.holding is not None else []
        for node in [*self.job.membership.failed, *holding]:
            self._lost.setdefault(node, (self.ctx.clock.monotonic(), self.ctx.clock.time()))
        if self.target <= 0 or self.job.state not in (RunState.RUNNING, RunState.RECOVERING):
            return
        coming = self.asking + len(self._granted) + len(self._returning)
        held = len(self.job.holding.faults) if self.job.holding is not None else 0  # a spare each, first
        short = self.target + held - len(self.job.membership.spares) - coming
        now = self.ctx.clock.monotonic()
        # One request at a time: two in flight were both given the same node once it came free
        # (Slurm shares nodes between allocations), and merging it twice took a CPU off the job.
        if short <= 0 or self.asking or now < self._next_try or self._blocked is not None:
            return
        if self.job.membership.ntasks_per_node > 1:
            self._blocked = (
                f"{self.job.membership.ntasks_per_node} tasks per node: a step of more than one task "
                "on a node merged into the job stays pending (Slurm 24.11, measured); the spare pool "
                "refills only jobs of one task per node for now"
            )
            self.ctx.events.append(ev.SPARE_REFUSED, error=self._blocked, seconds=0.0)
            logger.warning("%s", self._blocked)
            return
        self.asking += 1
        self.ctx.events.append(ev.SPARE_REQUESTED, held=len(self.job.membership.spares), target=self.target)
        lost = dict(self._lost)
        kept = {n: at for n, at in lost.items() if n in self.job.unreleased}
        thread = threading.Thread(
            target=self._ask, args=(now, lost, kept), name="torchpass-refill", daemon=True
        )
        thread.start()

    def give_back(self, node: str) -> None:
        """``node`` lost its rank but not its health: it rejoins as a spare once its old step
        has ended (the loop's thread)."""
        self._returning.append(Granted(node, self.ctx.clock.monotonic(), returned=True))
        self._lost.pop(node, None)

    def ready(self) -> list[Granted]:
        """Nodes to join now, once no recovery is in flight (a hold waits for them): every
        granted node, and every node given back whose old step has ended."""
        steady = self.job.migration is None and self.job.state == RunState.RUNNING
        if not (steady or self.job.holding is not None):
            return []
        back = [g for g in self._returning if self._old_step_ended(g.node)]
        self._returning = [g for g in self._returning if g not in back]
        offered, self._granted = self._granted + back, []
        m = self.job.membership
        taken: list[Granted] = []
        for g in offered:
            if g.node in m.active or g.node in m.spares or g.node in [t.node for t in taken]:
                # two requests in flight, each excluding the job's nodes as they were when it was
                # made: Slurm may merge a node into the job twice (measured: a node shared by two
                # allocations, on a cluster that lets jobs share nodes). It is the job's already.
                logger.info("Slurm gave %s again: it is the job's already", g.node)
                continue
            taken.append(g)
        return taken

    def _old_step_ended(self, node: str) -> bool:
        step = self.job.steps.get(node)
        return step is None or step.poll() is not None

    def close(self) -> None:
        """No more requests. One still pending is withdrawn: the supervisor's end would leave
        its salloc to be granted a node that nobody merges; a grant merged meanwhile ends with
        the job."""
        self._closing.set()
        if not self.asking:
            return
        try:
            self.ctx.slurm.cancel_expansion(self.job.job_id)
        except SlurmError as err:
            logger.warning("could not withdraw the request for a spare: %s", err)

    # -- Slurm, on the pool's thread --------------------------------------------------
    def _ask(
        self, requested_at: float, lost: dict[str, tuple[float, float]], kept: dict[str, tuple[float, float]]
    ) -> None:
        try:
            blocker = self._blocker()
            if blocker is not None:
                self._outcomes.put((requested_at, None, blocker, True, False))
                return
            alive = self._alive_in_job(kept) if kept else []
            if alive:  # in the allocation still, and alive: no request needed
                self._outcomes.put((requested_at, (alive[0],), "", False, True))
                return
            # never a node the job gave back as drained (maintenance, a bad health check), nor
            # one it lost that may be dead though Slurm does not know it yet
            exclude = sorted(set(self.job.released) | self._maybe_dead(requested_at, lost))
            nodes = self.ctx.slurm.expand_job(
                self.job.job_id, wait_s=round(self.ctx.config.refill_wait), exclude=exclude
            )
            self._outcomes.put((requested_at, nodes, "", False, False))
        except SlurmError as err:
            self._outcomes.put((requested_at, None, str(err), False, False))
        except Exception as err:  # deliberately broad: the thread must report, not die silently
            logger.exception("asking Slurm for a spare failed")
            self._outcomes.put((requested_at, None, repr(err), False, False))

    def _alive_in_job(self, kept: dict[str, tuple[float, float]]) -> list[str]:
        """The lost nodes still in the allocation that never went down: their slurmd has not
        restarted since the loss and accepts a connection (a rank that hung, a process killed).
        Not one powered off and on again: Slurm 22.05 kept its lost step running on it, and a
        new step there stayed pending (the bookworm dev cluster)."""
        if self.ctx.probe is None:
            return []
        same = self._not_restarted({n: wall for n, (_, wall) in kept.items()})
        return [n for n in sorted(same or ()) if self._answers(n)]

    def _maybe_dead(self, now: float, lost: dict[str, tuple[float, float]]) -> set[str]:
        """The lost nodes Slurm might still grant though they are dead: lost less than
        :data:`UNNOTICED_FACTOR` SlurmdTimeouts ago, their slurmd not started since and not
        accepting a connection now."""
        window = UNNOTICED_FACTOR * self._slurmd_timeout
        suspects = {n: wall for n, (at, wall) in lost.items() if now - at < window}
        if not suspects:
            return set()
        stale = self._not_restarted(suspects)
        if stale is None:
            return set(suspects)
        if self.ctx.probe is None:
            return stale
        return {n for n in stale if not self._answers(n)}

    def _not_restarted(self, lost_at: dict[str, float]) -> set[str] | None:
        """The nodes whose slurmd has not started since their loss (``lost_at``: unix time), or
        None when Slurm could not say."""
        try:
            started = self.ctx.slurm.slurmd_started(lost_at)
        except SlurmError as err:
            logger.info("could not read when slurmd started on %s (%s)", ",".join(lost_at), err)
            return None
        return {n for n, wall in lost_at.items() if started.get(n, 0.0) <= wall}

    def _answers(self, node: str) -> bool:
        assert self.ctx.probe is not None
        result = self.ctx.probe.probe_now(node)
        if result.slurmd:
            logger.info("%s may serve again: %s", node, result.detail)
        return result.slurmd

    def _blocker(self) -> str | None:
        """Why this cluster cannot refill (read once, on the first request), or None."""
        if self._checked:
            return None
        self._checked = True
        try:
            flags = self.ctx.slurm.config_value("PrologFlags") or ""
            timeout = self.ctx.slurm.config_value("SlurmdTimeout") or ""
        except SlurmError as err:
            logger.info("could not read slurmctld's settings (%s): asking for spares anyway", err)
            return None
        seconds = timeout.split()[0] if timeout else ""
        if seconds.isdigit():
            self._slurmd_timeout = float(seconds)
        if EXPANSION_BLOCKER not in [f.strip() for f in flags.split(",")]:
            return None
        return (
            f"PrologFlags={flags}: a node merged into a running job never runs the allocation "
            "prolog and its first step fails; the spare pool does not refill on this cluster"
        )

    def _collect(self) -> None:
        while True:
            try:
                requested_at, nodes, error, blocked, in_job = self._outcomes.get_nowait()
            except queue.Empty:
                return
            self.asking -= 1
            waited = round(self.ctx.clock.monotonic() - requested_at, 3)
            if blocked:
                self._blocked = error
                self.ctx.events.append(ev.SPARE_REFUSED, error=error, seconds=0.0)
                logger.warning("%s", error)
            elif nodes is None:
                self._next_try = self.ctx.clock.monotonic() + self.ctx.config.refill_retry
                self.ctx.events.append(ev.SPARE_REFUSED, error=error[:500], seconds=waited)
                logger.warning(
                    "Slurm gave no spare (again in %.0f s): %s", self.ctx.config.refill_retry, error
                )
            else:
                self._granted.extend(Granted(node, requested_at, in_job=in_job) for node in nodes)


def waited_s(granted: Granted, clock: Clock) -> float:
    """Seconds from the request of ``granted`` to now."""
    return round(clock.monotonic() - granted.requested_at, 3)
