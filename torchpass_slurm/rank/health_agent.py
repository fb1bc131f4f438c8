"""The in-job health agent: early warnings for pre-emptive migration.

One rank per node (local rank 0) runs :class:`HealthAgent`, a daemon thread
that gathers the node's health facts every ``TORCHPASS_HEALTH_INTERVAL``
seconds with the same checks as ``tp health check`` (the admin's config,
``TORCHPASS_HEALTH_CONFIG`` or /etc/torchpass/health.toml). The first time the
node turns WARNING or CRITICAL it reports ``health_warning`` to the
supervisor, which drains the node with a ``torchpass:`` reason; the drain
then moves the node's ranks to a spare while the node still works (a planned
migration) and releases the node. UNKNOWN (a check that broke) is logged,
never reported: it says nothing about the node.

On NVIDIA nodes (pynvml found, GPUs not simulated) the agent also starts an
:class:`~torchpass_slurm.health.gpu_events.NvmlEventWaiter`: GPU signals (XIDs,
the recovery action, ECC, remaps, throttling) judged by the table in
:mod:`torchpass_slurm.health.gpu_signals`. The worst verdict of what it finds
goes through the same ``health_warning`` report: ``move_now`` as status
CRITICAL, ``plan_move`` as WARNING (the summary names the signal, and so the
drain reason does); ``app_fault`` and ``unknown`` are logged, never reported.

The ECC-rate samples go to a per-job state file in the run folder: the job's
user need not be able to write the admin's state file.

The agent knows nothing of the rank runtime: it is given a :class:`Report`
callable (the runtime passes its ``report`` method), the node's name and the
local rank. :meth:`HealthAgent.close` stops its thread, waiting at most
:data:`CLOSE_TIMEOUT_S` for a check in flight.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from torchpass_slurm.config import (
    DEFAULT_HEALTH_INTERVAL_S,
    ENV_HEALTH_INTERVAL,
    ENV_RUN_DIR,
    env_float,
)
from torchpass_slurm.control.messages import ReportKind

if TYPE_CHECKING:
    from torchpass_slurm.health.gpu_events import NvmlEventWaiter
    from torchpass_slurm.health.gpu_signals import Finding
    from torchpass_slurm.health.run import HealthReport
    from torchpass_slurm.health.sources import DeviceSource

logger = logging.getLogger(__name__)

#: In TORCHPASS_HEALTH_SIMULATE, replaced by the node's name (one simulated file per node).
NODE_PLACEHOLDER = "{node}"

#: Seconds :meth:`HealthAgent.close` waits for the agent's thread to end. The
#: thread wakes at once when told to stop, unless a check is running: one check
#: is bounded by the health config's ``timeout_s``. Past this, close() logs and
#: returns (the thread is a daemon, and reports nothing once told to stop).
CLOSE_TIMEOUT_S = 5.0


class Report(Protocol):
    """Tells the supervisor a fact: ``report("health_warning", node=..., status=..., summary=...)``.

    :meth:`torchpass_slurm.rank.runtime.Runtime.report` is one.
    """

    def __call__(self, event: ReportKind, **fields: Any) -> None: ...


class HealthAgent(threading.Thread):
    """Checks this node's health periodically; reports the first warning."""

    def __init__(self, report: Report | None, node: str, interval: float) -> None:
        super().__init__(name="torchpass-health", daemon=True)
        #: None while the rank is a spare in standby: a warning is held until :meth:`deliver`
        self.report = report
        self.node = node
        self.interval = interval
        self.stopping = threading.Event()
        self.reported = False
        self._lock = threading.Lock()
        self._held: list[dict[str, Any]] = []
        self.gpu_events: NvmlEventWaiter | None = None

    @classmethod
    def maybe_start(cls, report: Report | None, *, node: str, local_rank: int) -> HealthAgent | None:
        """Start the agent on local rank 0 when ``TORCHPASS_HEALTH_INTERVAL`` is > 0.

        A spare starts it in standby with ``report`` None: its samples give the ECC rate a
        baseline from the job's start, so errors that rise while it is being promoted are a
        rate, not its first sample (a campaign fault injected 1 s after a promotion went
        unreported). What it finds meanwhile is held, and reported on :meth:`deliver`."""
        interval = env_float(ENV_HEALTH_INTERVAL, DEFAULT_HEALTH_INTERVAL_S)
        if interval <= 0 or local_rank != 0:
            return None
        agent = cls(report, node, interval)
        agent.start()
        return agent

    def deliver(self, report: Report) -> None:
        """The spare was promoted: report through ``report`` from now on, and what was held."""
        with self._lock:
            self.report, held, self._held = report, self._held, []
        for fields in held:
            report(ReportKind.HEALTH_WARNING, **fields)

    def _report(self, **fields: Any) -> None:
        with self._lock:
            report = self.report
            if report is None:
                self._held.append(fields)
                return
        report(ReportKind.HEALTH_WARNING, **fields)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the thread and wait up to ``timeout`` seconds for it (idempotent)."""
        self.stopping.set()
        if self.gpu_events is not None:
            self.gpu_events.close(timeout)
        if not self.is_alive():
            return
        self.join(timeout)
        if self.is_alive():
            logger.warning(
                "health agent on %s: its thread did not stop within %.1f s (a check is "
                "still running); leaving it, it reports nothing more",
                self.node,
                timeout,
            )

    def run(self) -> None:
        self.start_gpu_events()
        while not self.stopping.wait(self.interval) and not self.reported:
            try:
                health = self.check()
            except Exception as exc:  # deliberately broad: the agent must never hurt the training
                logger.warning("health agent on %s: the check failed: %s", self.node, exc)
                continue
            if self.stopping.is_set():  # closed while the check ran: the rank is leaving
                break
            self.judge(health)

    def check(self) -> HealthReport:
        from torchpass_slurm.health.config import SIMULATE_ENV, load_config
        from torchpass_slurm.health.run import run_health
        from torchpass_slurm.health.sources import select_source

        config = load_config()
        run_dir = os.environ.get(ENV_RUN_DIR)
        if run_dir:
            state = Path(run_dir) / ".torchpass" / f"health-{self.node}.json"
            config = dataclasses.replace(config, state_file=str(state))
        simulate = os.environ.get(SIMULATE_ENV, "")
        source: DeviceSource
        if NODE_PLACEHOLDER in simulate:
            from torchpass_slurm.health.sources.simulated import SimulatedSource

            source = SimulatedSource(simulate.replace(NODE_PLACEHOLDER, self.node))
        else:
            source = select_source(config)
        # Threads, not a forked child: this runs inside the training process.
        return run_health(config, source, node=self.node, isolate=False)

    def start_gpu_events(self) -> None:
        """Wait on NVML events when the node's GPUs are NVIDIA's and not simulated."""
        from torchpass_slurm.health.config import SIMULATE_ENV
        from torchpass_slurm.health.gpu_events import NvmlEventWaiter, nvml_available

        if os.environ.get(SIMULATE_ENV) or not nvml_available():
            return
        self.gpu_events = NvmlEventWaiter(self.on_gpu_findings, interval=self.interval)
        self.gpu_events.start()

    def on_gpu_findings(self, findings: Sequence[Finding]) -> None:
        """GPU signals: move_now -> CRITICAL, plan_move -> WARNING (the first only); the rest logged."""
        from torchpass_slurm.health.gpu_signals import Verdict, summary, worst

        for finding in findings:
            level = logging.INFO if finding.verdict == Verdict.NONE else logging.WARNING
            logger.log(level, "health agent on %s: %s", self.node, finding)
        verdict = worst(findings)
        if verdict not in (Verdict.MOVE_NOW, Verdict.PLAN_MOVE) or self.stopping.is_set():
            return
        with self._lock:
            if self.reported:
                return
            self.reported = True
        text = f"gpu: {summary(findings, verdict)}"[:300]
        if verdict == Verdict.MOVE_NOW:  # the supervisor moves the node now, not at a step boundary
            self._report(node=self.node, status="CRITICAL", summary=text, move_now=True)
        else:
            self._report(node=self.node, status="WARNING", summary=text)

    def judge(self, report: HealthReport) -> None:
        from torchpass_slurm.health.checks import Status

        bad = [r for r in report.results if r.status in (Status.WARNING, Status.CRITICAL)]
        if bad:  # even when another check broke (UNKNOWN ranks above WARNING in report.status)
            summary = "; ".join(r.message for r in bad)[:300]
            status = max(bad, key=lambda r: r.status).status.name
            self._report(node=self.node, status=status, summary=summary)
            self.reported = True
            logger.warning("health agent on %s: %s: %s", self.node, status, summary)
        elif report.status == Status.UNKNOWN:
            logger.info("health agent on %s: a check could not run (UNKNOWN); not reported", self.node)
