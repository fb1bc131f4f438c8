"""The goodput model: expected effective training time ratio (ETTR) and lost
GPU-hours per day of one training job, under checkpoint restart and under live
migration. Pure functions, no I/O; ``tp goodput`` is its shell and
``docs/goodput.md`` its documentation.

The process being modelled
--------------------------

A job holds ``N = gpus / gpus_per_node`` nodes. Each node fails as a Poisson
process of rate ``r_f`` per node-day, so the job sees faults as one Poisson
process of rate ``lam = N * r_f`` on the wall clock. Training progresses in
*segments* of ``s = tau + w``: ``tau`` of training, then ``w`` of checkpoint
write; only a finished segment counts (``tau`` of productive time).

* Checkpoint restart: a fault rolls the job back to its last checkpoint and
  costs a restart of ``R`` (detect, requeue, restore). A fault during the
  restart starts it again.
* Live migration: a fault is covered with probability ``c`` and then costs a
  pause of ``L`` (the measured recovery) with no rollback; a covered fault
  during the pause starts the pause again, an uncovered one (probability
  ``1 - c``) anywhere is handled as under checkpoint restart.

Closed form (exact for that process, by renewal-reward)::

    q    = exp(-lam L)
    p_ok = q / (q + (1 - q)(1 - c))                 pause ends without rollback
    E_p  = (1 - q) / (lam (q + (1 - q)(1 - c)))     expected pause (Wald)
    mu   = lam (1 - c) + lam c (1 - p_ok)           rollbacks per unit of progress
    E[segment] = (e^(mu s) - 1) [ (1 + lam c E_p) / mu + (e^(lam R) - 1) / lam ]
    ETTR = tau / E[segment]

With ``c = 0`` this is the classic ``e^(lam R) (e^(lam s) - 1) / lam`` per
segment; its first-order expansion is the per-failure rule "a fault costs the
restart plus half a segment of recompute"::

    ETTR ~ tau/s * (1 - lam [ (1 - c)(R + s/2) + c L ])

which :func:`ettr_first_order` returns. The study's estimator,
``E[ETTR] ~ (1 - N r_f (u0 + dt_cp/2)) / (1 + w_cp/dt_cp)``, is the same rule
with ``c = 0``, ``u0 = R``, ``dt_cp = tau``, ``w_cp = w``, except that it charges
a fault half an interval ``tau/2`` where this process loses half a segment
``s/2`` (a fault during a write loses the write too); with ``w = 0`` the two
are one formula. The rule goes negative when faults come faster than a
restart plus half an interval (131,072 GPUs), the exact form does not; both
agree to first order at small ``lam``.

:func:`simulate` draws the same process with a seeded generator and checks the
closed form.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

#: Faults per node per day on Meta's RSC-1 and RSC-2 research clusters (8 A100
#: per node): 6.50 and 2.34 per 1000 node-days, Kokolis et al., "Revisiting
#: Reliability in Large-Scale Machine Learning Research Clusters", HPCA 2025,
#: arXiv 2410.21680 (docs/goodput.md, "Sources").
RSC1_FAILURES_PER_NODE_DAY = 6.50e-3
RSC2_FAILURES_PER_NODE_DAY = 2.34e-3

#: The study's clusters by name (``tp goodput --cluster``).
CLUSTER_FAILURES_PER_NODE_DAY = {
    "rsc1": RSC1_FAILURES_PER_NODE_DAY,
    "rsc2": RSC2_FAILURES_PER_NODE_DAY,
}

#: Seconds in a day.
DAY_S = 86400.0

#: The share of faults live migration resolved with no lost progress in the fault campaign of
#: 2026-12-01 (50 of 50 faults of six classes on the bookworm dev cluster, 30-step jobs;
#: docs/benchmarks.md, "Fault campaign"; 94 % or more with 95 % confidence): the default of
#: ``tp goodput --live-coverage``.
MEASURED_LIVE_COVERAGE = 1.0


@dataclass(frozen=True)
class GoodputParams:
    """Everything the model needs but the job size. Times in seconds.

    The checkpoint-restart defaults are the study's: RSC-1's failure rate, a
    restart overhead ``u0`` of 5 minutes, hourly checkpoints whose writes do
    not stop training (docs/goodput.md, "Defaults"). ``live_recovery_s`` is
    the pause one node failure cost under live migration on this project's test
    cluster: from the power cut to the first committed step, rounded up
    (docs/benchmarks.md, "Detection by kind of fault"). ``live_coverage`` is the share the
    fault campaign measured (:data:`MEASURED_LIVE_COVERAGE`).
    """

    gpus_per_node: int = 8
    failure_rate_per_node_day: float = RSC1_FAILURES_PER_NODE_DAY
    ckpt_interval_s: float = 3600.0
    ckpt_write_s: float = 0.0
    restart_overhead_s: float = 300.0
    live_recovery_s: float = 2.0
    live_coverage: float = MEASURED_LIVE_COVERAGE

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if self.failure_rate_per_node_day < 0:
            raise ValueError(f"failure rate must be >= 0, got {self.failure_rate_per_node_day}")
        if self.ckpt_interval_s <= 0:
            raise ValueError(f"checkpoint interval must be > 0 s, got {self.ckpt_interval_s}")
        for name in ("ckpt_write_s", "restart_overhead_s", "live_recovery_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.live_coverage <= 1.0:
            raise ValueError(f"live_coverage must be in [0, 1], got {self.live_coverage}")

    def nodes(self, gpus: int) -> int:
        """Nodes a job of ``gpus`` GPUs holds (a partial node counts as one)."""
        if gpus < 1:
            raise ValueError(f"gpus must be >= 1, got {gpus}")
        return -(-gpus // self.gpus_per_node)

    def fault_rate_per_s(self, gpus: int) -> float:
        """``lam``: the job's faults per second of wall time."""
        return self.nodes(gpus) * self.failure_rate_per_node_day / DAY_S

    def checkpoint_restart(self) -> GoodputParams:
        """The same job without live migration (no fault is covered)."""
        return replace(self, live_coverage=0.0)


@dataclass(frozen=True)
class Goodput:
    """One answer: ETTR and what the job loses to faults and checkpoints."""

    gpus: int
    nodes: int
    faults_per_day: float
    ettr: float

    @property
    def lost_gpu_hours_per_day(self) -> float:
        return (1.0 - self.ettr) * self.gpus * 24.0


def _expm1_over(x: float, rate: float) -> float:
    """``(e^(rate x) - 1) / rate``, with its limit ``x`` at ``rate = 0``."""
    return x if rate == 0.0 else math.expm1(rate * x) / rate


def expected_segment_s(lam: float, p: GoodputParams) -> float:
    """Expected wall time to finish one checkpoint segment (module docstring)."""
    s = p.ckpt_interval_s + p.ckpt_write_s
    c, u, big_l = p.live_coverage, 1.0 - p.live_coverage, p.live_recovery_s
    q = math.exp(-lam * big_l)
    end = q + (1.0 - q) * u  # a pause attempt ends (well or by rollback)
    if end == 0.0:  # every fault covered and every pause interrupted: never ends
        return math.inf
    p_ok = q / end
    pause_per_fault = _expm1_over(big_l, lam) * q / end  # = (1 - q) / (lam * end)
    mu = lam * u + lam * c * (1.0 - p_ok)
    work = 1.0 + lam * c * pause_per_fault
    restart = _expm1_over(p.restart_overhead_s, lam)
    if mu == 0.0:
        return s * work
    return math.expm1(mu * s) * (work / mu + restart)


def ettr(gpus: int, p: GoodputParams) -> Goodput:
    """The closed form: expected ETTR of a job of ``gpus`` GPUs."""
    lam = p.fault_rate_per_s(gpus)
    value = p.ckpt_interval_s / expected_segment_s(lam, p)
    return Goodput(gpus, p.nodes(gpus), lam * DAY_S, value)


def ettr_first_order(gpus: int, p: GoodputParams) -> float:
    """The per-failure rule: ``tau/s * (1 - lam [(1-c)(R + s/2) + c L])``, floored at 0."""
    lam = p.fault_rate_per_s(gpus)
    s = p.ckpt_interval_s + p.ckpt_write_s
    c = p.live_coverage
    lost = lam * ((1.0 - c) * (p.restart_overhead_s + s / 2.0) + c * p.live_recovery_s)
    return max(0.0, p.ckpt_interval_s / s * (1.0 - lost))


def simulate(gpus: int, p: GoodputParams, *, faults: int = 20000, seed: int = 0) -> Goodput:
    """Monte-Carlo ETTR: run the process of the module docstring until ``faults``
    faults have struck, with ``random.Random(seed)``.

    Faults are the superposition of the nodes' Poisson processes (rate ``lam``).
    Between faults the job progresses; memorylessness lets a run of fault-free
    segments be counted at once, so the cost is one step per fault.
    """
    lam = p.fault_rate_per_s(gpus)
    nodes = p.nodes(gpus)
    if lam == 0.0:
        return Goodput(gpus, nodes, 0.0, p.ckpt_interval_s / (p.ckpt_interval_s + p.ckpt_write_s))
    rng = random.Random(seed)
    s = p.ckpt_interval_s + p.ckpt_write_s
    wall = 0.0
    segments = 0
    progress = 0.0  # into the current segment
    seen = 0

    def fault_in(duration: float) -> float | None:
        """Time to the next fault if it comes within ``duration``; counts it."""
        nonlocal wall, seen
        dt = rng.expovariate(lam)
        if dt >= duration:
            wall += duration
            return None
        wall += dt
        seen += 1
        return dt

    def restart() -> None:
        while fault_in(p.restart_overhead_s) is not None:
            pass

    while seen < faults:
        dt = rng.expovariate(lam)
        wall += dt
        seen += 1
        done, progress = divmod(progress + dt, s)
        segments += int(done)
        if rng.random() >= p.live_coverage:
            progress = 0.0
            restart()
            continue
        while True:  # a covered fault: pause, no rollback unless an uncovered one strikes
            if fault_in(p.live_recovery_s) is None:
                break
            if rng.random() >= p.live_coverage:
                progress = 0.0
                restart()
                break
    return Goodput(gpus, nodes, lam * DAY_S, segments * p.ckpt_interval_s / wall)
