"""One health run: gather the facts once (bounded in time), judge them, report.

::

    config ──► select_source ──► gather_facts (device and host in two forked children,
                                  both killed at config.timeout_s)
                                      │ Facts (frozen)
                                      ▼
                                 run_checks ──► HealthReport (worst status = exit code)
                                      │
                                      └─► state file (next ECC samples)

A device library that hangs (an NVML call stuck in the driver), stalls holding
the GIL, exits or crashes is killed with its child (:mod:`.child`) and turns
every GPU check UNKNOWN when the time is up: the run ends by its deadline
whatever the library does. ``isolate=False`` gathers in two daemon threads
instead (the in-job agent: a training process is not forked); a thread that
hangs is left behind, and one that holds the GIL can hold the run past it.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

from torchpass_slurm.errors import SourceError
from torchpass_slurm.health.checks import CheckResult, Status, run_checks, worst
from torchpass_slurm.health.child import Child, ChildFailed
from torchpass_slurm.health.config import HealthConfig
from torchpass_slurm.health.facts import (
    DiskFacts,
    Facts,
    GpuFacts,
    HostFacts,
    gpus_from_json,
    gpus_to_json,
    host_from_json,
    host_to_json,
)
from torchpass_slurm.health.host import gather_host
from torchpass_slurm.health.sources import DeviceSource
from torchpass_slurm.health.state import next_samples, read_samples, write_samples

logger = logging.getLogger(__name__)

__all__ = ["HealthReport", "gather_facts", "local_node_name", "run_health"]

T = TypeVar("T")


@dataclass(frozen=True)
class HealthReport:
    """The outcome of one run; ``status`` is the exit code."""

    node: str
    source: str
    time: float
    duration_s: float
    results: tuple[CheckResult, ...]

    @property
    def status(self) -> Status:
        return worst(self.results)

    def findings(self, status: Status) -> list[CheckResult]:
        """The results with exactly ``status``."""
        return [r for r in self.results if r.status == status]

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` document."""
        return {
            "node": self.node,
            "source": self.source,
            "time": self.time,
            "duration_s": round(self.duration_s, 3),
            "status": self.status.name,
            "exit_code": int(self.status),
            "results": [r.as_dict() for r in self.results],
        }


class _Bounded(Generic[T]):
    """Run ``fn`` in a daemon thread; :meth:`result` waits until a deadline."""

    def __init__(self, fn: Callable[[], T], name: str) -> None:
        self._value: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], T]) -> None:
        try:
            self._value = fn()
        except BaseException as err:  # handed to the caller, never lost in the thread
            self._error = err

    def result(self, deadline: float, clock: Callable[[], float]) -> T:
        """The value; raises the function's error, or TimeoutError when the deadline passed."""
        self._thread.join(max(0.0, deadline - clock()))
        if self._thread.is_alive():
            raise TimeoutError
        if self._error is not None:
            raise self._error
        return cast(T, self._value)  # fn() returned it: the thread ended without an error


def local_node_name() -> str:
    """The Slurm node name: ``$SLURMD_NODENAME`` (set for Prolog/Epilog/HealthCheckProgram),
    else the short host name."""
    import os

    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def _device_facts(
    task: _Bounded[tuple[GpuFacts, ...]] | Child[tuple[GpuFacts, ...]],
    deadline: float,
    timeout: float,
    clock: Callable[[], float],
) -> tuple[tuple[GpuFacts, ...] | None, str | None]:
    try:
        return task.result(deadline, clock), None
    except TimeoutError:
        return None, f"the device source did not answer within {timeout:g} s (timeout_s)"
    except SourceError as err:
        return None, err.message
    except ChildFailed as err:  # what it raised in the child ("SystemExit: 2"), or how it died
        return None, f"the device source failed: {err}"
    # Deliberately broad: a source bug or a library error the source did not expect
    # means the check broke, not the node (UNKNOWN, never a crash of the hook). A
    # library that calls sys.exit() in the device thread arrives here as SystemExit.
    except (Exception, SystemExit) as err:
        logger.debug("device source failed", exc_info=True)
        return None, f"the device source failed: {type(err).__name__}: {err}"


def _host_facts(
    task: _Bounded[HostFacts] | Child[HostFacts],
    deadline: float,
    timeout: float,
    paths: Sequence[str],
    clock: Callable[[], float],
) -> HostFacts:
    try:
        return task.result(deadline, clock)
    except TimeoutError:
        why = f"did not finish within {timeout:g} s (timeout_s; a hung file system?)"
    except ChildFailed as err:
        why = f"failed: {err}"
    except Exception as err:  # deliberately broad: gather_host turns OSError into facts, so this is a bug
        why = f"failed: {type(err).__name__}: {err}"
    return HostFacts(error=f"gathering host facts {why}", disks=tuple(DiskFacts(p, error=why) for p in paths))


def gather_facts(
    config: HealthConfig,
    source: DeviceSource,
    *,
    node: str,
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time,
    host: Callable[[], HostFacts] | None = None,
    isolate: bool = True,
) -> Facts:
    """Every fact of this run, at most ``config.timeout_s`` after the call (see the module doc)."""
    deadline = clock() + config.timeout_s
    host_fn = host or (lambda: gather_host(config.disk_paths))
    device_task: _Bounded[tuple[GpuFacts, ...]] | Child[tuple[GpuFacts, ...]]
    host_task: _Bounded[HostFacts] | Child[HostFacts]
    if isolate:
        device_task = Child(source.gpus, gpus_to_json, gpus_from_json, "the device source")
        host_task = Child(host_fn, host_to_json, host_from_json, "the host facts")
    else:
        device_task = _Bounded(source.gpus, "health-device")
        host_task = _Bounded(host_fn, "health-host")
    gpus, gpu_error = _device_facts(device_task, deadline, config.timeout_s, clock)
    return Facts(
        time=wall_clock(),
        node=node,
        source=source.name,
        gpus=gpus,
        gpu_error=gpu_error,
        host=_host_facts(host_task, deadline, config.timeout_s, config.disk_paths, clock),
        previous_ecc=read_samples(config.state_file) if config.state_file else {},
    )


def run_health(
    config: HealthConfig,
    source: DeviceSource,
    *,
    node: str | None = None,
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time,
    host: Callable[[], HostFacts] | None = None,
    isolate: bool = True,
) -> HealthReport:
    """Gather, judge, store the next ECC samples; never raises for a device or host failure."""
    started = clock()
    facts = gather_facts(
        config,
        source,
        node=node or local_node_name(),
        clock=clock,
        wall_clock=wall_clock,
        host=host,
        isolate=isolate,
    )
    results = tuple(run_checks(facts, config))
    if facts.gpus is not None and config.state_file:
        write_samples(config.state_file, next_samples(facts, config))
    report = HealthReport(facts.node, facts.source, facts.time, clock() - started, results)
    logger.info("health of %s: %s in %.2f s", report.node, report.status.name, report.duration_s)
    return report
