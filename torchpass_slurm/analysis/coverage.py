"""Coverage from spares: the share of a job's faults that live migration can
resolve, from the spares it reserves, the job's length and the pool's refill.
Pure functions, no I/O; it gives :mod:`~torchpass_slurm.analysis.goodput` its
``live_coverage`` (``tp goodput --spares``; ``docs/goodput.md``, "Coverage from
spares").

The process being modelled
--------------------------

A job reserves ``S`` spares and lives ``D`` of wall time; faults strike it as a
Poisson process of rate ``lam`` (the goodput model's). Every fault takes a
ready spare if there is one: a live migration, or a restart on spares
(``supervisor/plan.py``). A share ``u`` of faults (``uncoverable``) no spare can
cover whatever the pool: e.g. a fault that takes every copy of a shard, whose
state then exists nowhere (plan.py's fallback "no replica").

* **No refill.** The pool never refills: the job survives live only its first
  ``S`` faults. With ``K ~ Poisson(lam D)`` faults over the job::

      c = (1 - u) E[min(K, S)] / E[K]          -> (1 - u) as lam D -> 0 (S >= 1)
                                               -> 0       as lam D -> infinity

* **Refill of time T.** After a spare is used, Slurm is asked for a node, a
  ready spare ``T`` later (``supervisor/refill.py``). The spares in refill are
  an Erlang loss system M/G/S/S of offered load ``a = lam T``: a fault finds
  the pool empty with probability Erlang B, insensitive to the distribution
  of ``T``, computed by the stable recursion::

      B(0) = 1,   B(k) = a B(k-1) / (k + a B(k-1)),   B = B(S)

  A fault that finds the pool empty is *held*: the survivors keep the
  committed step up to ``W`` (``spare_wait``, ``supervisor/hold.py``) and it is
  still live if a node arrives meanwhile, with a longer pause. Given the pool
  empty, the ``S`` refills in flight have i.i.d. residual times with the
  equilibrium distribution of ``T`` (exact for the stationary M/G/S/S, and
  what a fault sees, by PASTA). **Assumption: T is deterministic**, so the
  residuals are uniform on ``[0, T]`` and the held fault takes the earliest::

      p_W  = P(min of S residuals <= W) = 1 - (1 - W/T)^S   (W < T);   1 when W >= T
      E_W  = E[that minimum | it is <= W]
           = (T/(S+1) (1 - (1 - W/T)^(S+1)) - W (1 - W/T)^S) / p_W;  T/(S+1) when W >= T
      c    = (1 - u) ((1 - B) + B p_W)
      mean wait per covered fault = B p_W E_W / ((1 - B) + B p_W)

  The goodput model adds that mean wait to the pause ``L`` of every covered
  fault (:func:`live_params`): exact for the mean pause, first order for ETTR.
  With refill times that vary, ``B`` is unchanged and ``p_W`` is lower at equal
  mean (exponential: ``1 - exp(-S W / T)``); with ``W >= T`` and deterministic
  ``T`` the closed form covers every held fault.

What the closed form leaves out, and by how much:

* **A held loss adds load.** The loss system drops a fault that finds the
  pool empty; here a held loss asks for a node of its own (``refill.py``), so
  one that a node reaches costs a refill like any other. If every held fault
  is reached (``W >= T``, shared holds aside), the refills in flight are an
  M/G/infinity system, ``Poisson(a)`` in steady state, and the pool is empty
  with probability ``B+ = P(Poisson(a) >= S)`` (:func:`blocking_upper`); if
  every one timed out it would be ``B``. The process lies between the two, which differ by a
  factor ``1 + O(a)``: ``a = 0.046`` (16,384 GPUs, ``T = 300`` s), ``S = 2``:
  ``B = 0.00102``, ``B+ = 0.00104``; ``a = 0.5``, ``S = 1``: 0.33 and 0.39.
* **A hold shared by two faults.** A fault during a hold joins it, but the
  hold's deadline counts from its first loss and the later loss waits for a
  later node, so it may time out where the formula says covered.
* Together (:func:`hold_error_bound`; argued, not proved: the simulation stays
  inside it in every case the tests draw)::

      c - c_process <= (1 - u) [ (B+ - B)(1 - p_W) + B+ (1 - exp(-2 lam W)) ]

  the blocking beyond ``B`` where a held fault may time out, and a held fault
  with another fault within ``W`` before or after it: 0.004 at 16,384 GPUs,
  ``S = 1`` and ``T = W = 300`` s.
* The pool starts full: the blocking reaches its steady state only after
  about ``T``, so over a job of ``D >> T`` the coverage is higher by
  ``O(T/D)`` at most.
* Refills run in parallel here; ``supervisor/refill.py`` asks for one node at
  a time, so a second request (``S >= 2``, or a held loss's own) queues
  behind the first. The two agree to first order in ``a``. Simulated with
  10^6 faults at 16,384 GPUs and ``W = 300`` s, coverage in parallel and one
  at a time: ``S = 1``, ``T = 300`` s: 0.980 and 0.979 (closed form 0.980);
  ``S = 2``, ``T = 3000`` s (``a = 0.46``): 0.924 and 0.906 (closed form
  0.926). :func:`simulate_coverage` draws both.
* A spare that dies on standby also uses a refill (``S r_f`` more load): not
  counted, ``S`` is small against the job's nodes.
* With ``S = 0`` there is no pool to refill and no hold: ``c = 0``.

:func:`simulate_coverage` draws the pool, the holds and their deadlines with a
seeded generator and checks the closed form.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass, replace

from torchpass_slurm.analysis.goodput import DAY_S, GoodputParams
from torchpass_slurm.config import SupervisorConfig

__all__ = [
    "DEFAULT_REFILL_S",
    "DEFAULT_UNCOVERABLE",
    "SpareParams",
    "Coverage",
    "erlang_b",
    "blocking_upper",
    "coverage",
    "hold_error_bound",
    "live_params",
    "simulate_coverage",
]

#: Seconds from asking Slurm for a replacement node to a ready spare on standby: the slowest
#: measured on the dev cluster with an idle node (2 to 11 s; docs/goodput.md, "Coverage from spares").
DEFAULT_REFILL_S = 11.0

#: The share of faults no spare can cover (every copy of a shard lost): the project's aim is
#: 98 % covered.
DEFAULT_UNCOVERABLE = 0.02


@dataclass(frozen=True)
class SpareParams:
    """The spare pool of one job. Times in seconds; ``refill_s`` None: the pool never refills."""

    spares: int = 1
    refill_s: float | None = DEFAULT_REFILL_S
    spare_wait_s: float = SupervisorConfig.spare_wait
    job_days: float = 14.0
    uncoverable: float = DEFAULT_UNCOVERABLE

    def __post_init__(self) -> None:
        if self.spares < 0:
            raise ValueError(f"spares must be >= 0, got {self.spares}")
        if self.refill_s is not None and not 0.0 <= self.refill_s < math.inf:  # NaN too
            raise ValueError(f"refill_s must be a finite number >= 0 or None, got {self.refill_s}")
        if not 0.0 <= self.spare_wait_s < math.inf:
            raise ValueError(f"spare_wait_s must be a finite number >= 0, got {self.spare_wait_s}")
        if not 0.0 < self.job_days < math.inf:
            raise ValueError(f"job_days must be a finite number > 0, got {self.job_days}")
        if not 0.0 <= self.uncoverable <= 1.0:
            raise ValueError(f"uncoverable must be in [0, 1], got {self.uncoverable}")

    @property
    def job_s(self) -> float:
        return self.job_days * DAY_S

    def no_refill(self) -> SpareParams:
        """The same pool that never refills."""
        return replace(self, refill_s=None)


@dataclass(frozen=True)
class Coverage:
    """One answer, closed form or simulated.

    ``blocked``: the share of faults that find no ready spare; ``held_covered``: the share
    of the held faults (coverable, pool empty, a refill coming) that a node reaches within
    the spare wait; ``mean_wait_s``: their mean wait.
    """

    faults_per_job: float
    coverage: float
    blocked: float
    held_covered: float
    mean_wait_s: float

    @property
    def extra_pause_s(self) -> float:
        """The mean wait added to a covered fault's pause (held or not)."""
        live = (1.0 - self.blocked) + self.blocked * self.held_covered
        return 0.0 if live == 0.0 else self.blocked * self.held_covered * self.mean_wait_s / live


def erlang_b(servers: int, load: float) -> float:
    """Erlang B: the probability that an arrival finds all ``servers`` busy, offered ``load``
    erlangs (stable recursion; ``B(0, a) = 1``, ``B(1, a) = a / (1 + a)``)."""
    if servers < 0 or not 0.0 <= load < math.inf:
        raise ValueError(f"need servers >= 0 and a finite load >= 0, got {servers}, {load}")
    b = 1.0
    for k in range(1, servers + 1):
        b = load * b / (k + load * b)
    return b


def blocking_upper(spares: int, load: float) -> float:
    """``P(Poisson(load) >= spares)``: the pool is empty this often when every held loss is
    reached and asks for a node of its own (refills in flight as M/G/infinity); the upper
    bound to :func:`erlang_b`'s lower one (module docstring)."""
    if spares < 0 or not 0.0 <= load < math.inf:
        raise ValueError(f"need spares >= 0 and a finite load >= 0, got {spares}, {load}")
    if spares == 0:
        return 1.0
    return 0.0 if load == 0.0 else _poisson_tail(spares - 1, load)


def _poisson_pmf(k: int, mean: float) -> float:
    return math.exp(k * math.log(mean) - mean - math.lgamma(k + 1))


def _poisson_tail(k: int, mean: float) -> float:
    """``P(K > k)``, ``K ~ Poisson(mean > 0)``: the smaller side is summed, so no cancellation."""
    if k + 1 <= mean:
        return max(0.0, 1.0 - sum(_poisson_pmf(j, mean) for j in range(k + 1)))
    total, j = 0.0, k + 1
    term = _poisson_pmf(j, mean)
    while term > 0.0 and term > 1e-17 * total:  # terms fall once j > mean
        total += term
        j += 1
        term *= mean / j
    return total


def _no_refill(lam: float, pool: SpareParams) -> Coverage:
    mean = lam * pool.job_s
    if pool.spares == 0:
        return Coverage(mean, 0.0, 1.0, 0.0, 0.0)
    if mean == 0.0:  # the limit lam D -> 0: the first fault always finds a spare
        return Coverage(0.0, 1.0 - pool.uncoverable, 0.0, 0.0, 0.0)
    served = sum(_poisson_tail(k, mean) for k in range(pool.spares)) / mean  # E[min(K, S)] / E[K]
    return Coverage(mean, (1.0 - pool.uncoverable) * served, 1.0 - served, 0.0, 0.0)


def _earliest_refill(spares: int, refill_s: float, wait_s: float) -> tuple[float, float]:
    """``(p_W, E_W)``: the earliest of ``spares`` uniform residuals on ``[0, refill_s]``
    comes within ``wait_s``, and its mean given that (module docstring)."""
    if wait_s >= refill_s:
        return 1.0, refill_s / (spares + 1)
    left = 1.0 - wait_s / refill_s
    p = 1.0 - left**spares
    if p == 0.0:  # W = 0: no hold
        return 0.0, 0.0
    mean = (refill_s / (spares + 1) * (1.0 - left ** (spares + 1)) - wait_s * left**spares) / p
    return p, mean


def coverage(lam: float, pool: SpareParams) -> Coverage:
    """The closed form (module docstring) for a job seeing ``lam`` faults per second."""
    if not 0.0 <= lam < math.inf:
        raise ValueError(f"the fault rate must be a finite number >= 0, got {lam}")
    if pool.refill_s is None:
        return _no_refill(lam, pool)
    mean = lam * pool.job_s
    if pool.spares == 0:
        return Coverage(mean, 0.0, 1.0, 0.0, 0.0)
    blocked = erlang_b(pool.spares, lam * pool.refill_s)
    p_w, e_w = _earliest_refill(pool.spares, pool.refill_s, pool.spare_wait_s)
    c = (1.0 - pool.uncoverable) * ((1.0 - blocked) + blocked * p_w)
    return Coverage(mean, c, blocked, p_w, e_w)


def hold_error_bound(lam: float, pool: SpareParams) -> float:
    """How far the closed form's coverage may be above the process's (module docstring):
    ``(1 - u) [(B+ - B)(1 - p_W) + B+ (1 - exp(-2 lam W))]``; 0 without refill (exact)."""
    if pool.refill_s is None or pool.spares == 0:
        return 0.0
    load = lam * pool.refill_s
    low, high = erlang_b(pool.spares, load), blocking_upper(pool.spares, load)
    p_w, _ = _earliest_refill(pool.spares, pool.refill_s, pool.spare_wait_s)
    shared = -math.expm1(-2.0 * lam * pool.spare_wait_s)
    return (1.0 - pool.uncoverable) * ((high - low) * (1.0 - p_w) + high * shared)


def live_params(gpus: int, params: GoodputParams, pool: SpareParams) -> tuple[Coverage, GoodputParams]:
    """The coverage of a job of ``gpus`` GPUs, and the goodput parameters it implies: that
    coverage, and the pause of a covered fault lengthened by its mean wait for a spare."""
    cov = coverage(params.fault_rate_per_s(gpus), pool)
    pause = params.live_recovery_s + cov.extra_pause_s
    return cov, replace(params, live_coverage=cov.coverage, live_recovery_s=pause)


def simulate_coverage(
    lam: float,
    pool: SpareParams,
    *,
    faults: int = 20000,
    seed: int = 0,
    serial: bool = False,
    exponential: bool = False,
) -> Coverage:
    """Monte-Carlo coverage: jobs of ``pool.job_days`` one after another, each starting with a
    full pool, until ``faults`` faults have struck, with ``random.Random(seed)``.

    Unlike the closed form it follows every hold: a fault during a hold joins it (and asks
    for a node of its own), the hold's deadline counts from its first loss, and a hold that
    times out withdraws its requests. ``serial``: one request at a time, as
    ``supervisor/refill.py`` asks; ``exponential``: refill times exponential of mean
    ``refill_s`` instead of fixed. Jobs without a fault are skipped at once (memorylessness),
    so the cost is one step per fault; with ``lam = 0`` nothing strikes and the closed form
    is returned.
    """
    if lam == 0.0:
        return coverage(lam, pool)
    run = _Run(lam, pool, random.Random(seed), serial, exponential)
    jobs = 0
    while run.faults < faults:
        skipped, first = divmod(run.rng.expovariate(lam), pool.job_s)
        jobs += int(skipped) + 1
        run.job(first)
    return Coverage(
        run.faults / jobs,
        run.covered / run.faults,
        run.blocked / run.faults,
        run.held_ok / run.held if run.held else 0.0,
        run.waited / run.held_ok if run.held_ok else 0.0,
    )


class _Run:
    """The pool through one job at a time, and the tallies over all jobs. Invariant outside
    a fault: ready + refills in flight - held losses = S."""

    def __init__(
        self, lam: float, pool: SpareParams, rng: random.Random, serial: bool, exponential: bool
    ) -> None:
        self.lam, self.pool, self.rng = lam, pool, rng
        self.serial, self.exponential = serial, exponential
        self.faults = self.covered = self.blocked = self.held = self.held_ok = 0
        self.waited = 0.0
        self.ready = pool.spares
        self.inflight: list[tuple[float, int]] = []  # (completion time, request number), sorted
        self.asked = 0  # requests made so far: the latest are withdrawn first
        self.holding: list[float] = []  # when each held loss struck, oldest first
        self.deadline = math.inf

    def job(self, t: float) -> None:
        """One job whose first fault strikes at ``t``; a hold open at its end is decided."""
        self.ready, self.inflight, self.holding, self.deadline = self.pool.spares, [], [], math.inf
        while t < self.pool.job_s:
            self.settle(t)
            self.fault(t)
            t += self.rng.expovariate(self.lam)
        self.settle(math.inf)

    def settle(self, now: float) -> None:
        """Refills that complete and a hold that times out before ``now``, in time order."""
        while True:
            done = self.inflight[0][0] if self.inflight else math.inf
            if self.holding and self.deadline < min(done, now):  # a node at the deadline is in time
                self.withdraw(len(self.holding))
                self.holding, self.deadline = [], math.inf
            elif done < now:
                self.inflight.pop(0)
                if self.holding:
                    self.held_ok += 1
                    self.covered += 1
                    self.waited += done - self.holding.pop(0)
                    if not self.holding:
                        self.deadline = math.inf
                else:
                    self.ready += 1
            else:
                return

    def fault(self, t: float) -> None:
        self.faults += 1
        coverable = self.rng.random() >= self.pool.uncoverable
        if self.ready > 0:  # a live migration, or a restart on spares: either takes the spare
            self.ready -= 1
            self.covered += coverable
            self.request(t)
            return
        self.blocked += 1
        if not coverable or self.pool.refill_s is None or self.pool.spares == 0:
            return  # a checkpoint restart; no hold where the pool cannot refill
        self.held += 1
        if not self.holding:
            self.deadline = t + self.pool.spare_wait_s
        self.holding.append(t)
        self.request(t)

    def request(self, t: float) -> None:
        """Ask for a node at ``t`` (no-op without refill)."""
        refill = self.pool.refill_s
        if refill is None:
            return
        took = self.rng.expovariate(1.0 / refill) if self.exponential and refill > 0 else refill
        start = max(t, self.inflight[-1][0]) if self.serial and self.inflight else t
        self.asked += 1
        bisect.insort(self.inflight, (start + took, self.asked))

    def withdraw(self, count: int) -> None:
        """A hold timed out: its ``count`` losses' requests, the latest made, are withdrawn
        (all made since the hold began were its own: the pool was empty)."""
        latest = sorted(self.inflight, key=lambda item: item[1])[-count:]
        self.inflight = [item for item in self.inflight if item not in latest]
