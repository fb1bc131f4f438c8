"""Pure checks: ``check_<area>_<thing>(facts, config) -> list[CheckResult]``.

No check gathers anything or has side effects; each reads the frozen
:class:`~torchpass_slurm.health.facts.Facts` and quotes the value it saw and
the threshold it compared against. GPU checks are UNKNOWN when the device
source failed or the field's own query failed: "the check broke" is never
reported as "the node is bad".
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from torchpass_slurm.health.config import HealthConfig
from torchpass_slurm.health.facts import DiskFacts, Facts, GpuFacts

__all__ = ["CHECKS", "CheckResult", "Status", "ecc_rate_per_hour", "run_checks", "worst"]


class Status(enum.IntEnum):
    """Nagios status; the value is the exit code."""

    OK = 0
    WARNING = 1
    CRITICAL = 2
    UNKNOWN = 3

    @property
    def severity(self) -> int:
        """Order for "the worst": OK < WARNING < UNKNOWN < CRITICAL (a bad node beats a broken check)."""
        return {0: 0, 1: 1, 3: 2, 2: 3}[int(self)]

    @classmethod
    def from_word(cls, word: str) -> Status:
        return cls[word.upper()]


@dataclass(frozen=True)
class CheckResult:
    """One finding of one check: for the node (``gpu`` None) or one GPU."""

    check: str
    status: Status
    message: str
    gpu: int | None = None

    def as_dict(self) -> dict[str, object]:
        return {"check": self.check, "status": self.status.name, "gpu": self.gpu, "message": self.message}


Check = Callable[[Facts, HealthConfig], list[CheckResult]]


def worst(results: Iterable[CheckResult]) -> Status:
    """The worst status of ``results`` (OK when there are none)."""
    return max((r.status for r in results), key=lambda s: s.severity, default=Status.OK)


def _gpu_label(gpu: GpuFacts) -> str:
    return f"GPU {gpu.index}"


def _per_gpu(
    name: str, facts: Facts, judge: Callable[[GpuFacts], tuple[Status, str]], fields: Sequence[str]
) -> list[CheckResult]:
    """Run ``judge`` on every GPU that is not lost; UNKNOWN where the source or a field query failed."""
    if facts.gpus is None:
        return [CheckResult(name, Status.UNKNOWN, f"no GPU facts: {facts.gpu_error}")]
    results = []
    for gpu in facts.gpus:
        if gpu.lost:
            continue  # check_gpu_count reports lost GPUs
        failed = gpu.error_for(*fields)
        if failed is not None:
            results.append(
                CheckResult(name, Status.UNKNOWN, f"{_gpu_label(gpu)}: query failed: {failed}", gpu.index)
            )
            continue
        status, message = judge(gpu)
        results.append(CheckResult(name, status, f"{_gpu_label(gpu)}: {message}", gpu.index))
    return results


def _not_reported(what: str, source: str) -> tuple[Status, str]:
    return Status.OK, f"{what} not reported by the {source} source; skipped"


def check_gpu_count(facts: Facts, config: HealthConfig) -> list[CheckResult]:
    """GPUs visible and answering against ``expected_gpus``; a lost GPU is CRITICAL."""
    name = "gpu_count"
    if facts.gpus is None:
        if config.expected_gpus == 0:
            return [
                CheckResult(
                    name, Status.OK, f"no GPU expected (expected_gpus = 0); source: {facts.gpu_error}"
                )
            ]
        return [CheckResult(name, Status.UNKNOWN, f"no GPU facts: {facts.gpu_error}")]
    lost = [g for g in facts.gpus if g.lost]
    working = len(facts.gpus) - len(lost)
    results = [
        CheckResult(name, Status.CRITICAL, f"{_gpu_label(g)} is lost (fell off the bus)", g.index)
        for g in lost
    ]
    expected = config.expected_gpus
    if expected == 0:
        results.append(
            CheckResult(name, Status.OK, f"{working} GPU(s) working; count not checked (expected_gpus = 0)")
        )
    elif working < expected:
        results.append(CheckResult(name, Status.CRITICAL, f"{working} GPU(s) working, expected {expected}"))
    else:
        results.append(CheckResult(name, Status.OK, f"{working} GPU(s) working, expected {expected}"))
    return results


def check_gpu_ecc_uncorrected(facts: Facts, config: HealthConfig) -> list[CheckResult]:
    """Uncorrected (volatile) ECC errors at or above ``ecc_uncorrected_critical``."""
    limit = config.ecc_uncorrected_critical

    def judge(gpu: GpuFacts) -> tuple[Status, str]:
        if gpu.ecc_uncorrected is None:
            return _not_reported("uncorrected ECC count", facts.source)
        status = Status.CRITICAL if limit and gpu.ecc_uncorrected >= limit else Status.OK
        return status, f"{gpu.ecc_uncorrected} uncorrected ECC error(s) (critical at {limit})"

    return _per_gpu("gpu_ecc_uncorrected", facts, judge, ["ecc_uncorrected"])


def ecc_rate_per_hour(gpu: GpuFacts, facts: Facts, config: HealthConfig) -> float | None:
    """Corrected ECC errors per hour since the stored sample; None when there is none to compare.

    No rate when there is no sample, it is younger than ``ecc_rate_min_interval_s``, or
    the counter went down (the driver reset it: the sample is a new baseline).
    """
    before = facts.previous_ecc.get(gpu.uuid)
    if before is None or gpu.ecc_corrected is None:
        return None
    elapsed = facts.time - before.time
    if elapsed < max(config.ecc_rate_min_interval_s, 1.0) or gpu.ecc_corrected < before.ecc_corrected:
        return None
    return (gpu.ecc_corrected - before.ecc_corrected) * 3600.0 / elapsed


def check_gpu_ecc_corrected_rate(facts: Facts, config: HealthConfig) -> list[CheckResult]:
    """Rate of corrected ECC errors per hour against the warning and critical rates."""

    def judge(gpu: GpuFacts) -> tuple[Status, str]:
        if gpu.ecc_corrected is None:
            return _not_reported("corrected ECC count", facts.source)
        rate = ecc_rate_per_hour(gpu, facts, config)
        if rate is None:
            return (
                Status.OK,
                f"{gpu.ecc_corrected} corrected ECC error(s); no earlier sample to take a rate from yet",
            )
        warn, crit = config.ecc_corrected_rate_warning, config.ecc_corrected_rate_critical
        text = f"corrected ECC rate {rate:.1f}/h (warning at {warn:g}/h, critical at {crit:g}/h)"
        return _grade(rate, warn, crit), text

    return _per_gpu("gpu_ecc_corrected_rate", facts, judge, ["ecc_corrected"])


def _grade(value: float, warn: float, crit: float) -> Status:
    """CRITICAL at or above ``crit``, WARNING at or above ``warn``; a 0 threshold is off."""
    if crit and value >= crit:
        return Status.CRITICAL
    if warn and value >= warn:
        return Status.WARNING
    return Status.OK


def _grade_low(value: float, warn: float, crit: float) -> Status:
    """CRITICAL below ``crit``, WARNING below ``warn``; a 0 threshold is off."""
    if crit and value < crit:
        return Status.CRITICAL
    if warn and value < warn:
        return Status.WARNING
    return Status.OK


def check_gpu_retired_pages(facts: Facts, config: HealthConfig) -> list[CheckResult]:
    """Retired pages and remapped rows: a failed remap or too many retired pages is CRITICAL;
    a pending retirement/remap (needs a GPU reset) gets ``retired_pages_pending_status``."""
    pending_status = Status.from_word(config.retired_pages_pending_status)
    limit = config.retired_pages_critical

    def judge(gpu: GpuFacts) -> tuple[Status, str]:
        if gpu.remapped_rows_failure:
            return Status.CRITICAL, "row remapping failed"
        if limit and gpu.retired_pages is not None and gpu.retired_pages >= limit:
            return Status.CRITICAL, f"{gpu.retired_pages} retired pages (critical at {limit})"
        if gpu.retired_pages_pending or gpu.remapped_rows_pending:
            return pending_status, "page retirement or row remap pending (needs a GPU reset)"
        if (
            gpu.retired_pages is None
            and gpu.retired_pages_pending is None
            and gpu.remapped_rows_pending is None
        ):
            return _not_reported("retired pages and remapped rows", facts.source)
        shown = "?" if gpu.retired_pages is None else gpu.retired_pages
        return Status.OK, f"{shown} retired pages (critical at {limit}), nothing pending"

    fields = ["retired_pages", "retired_pages_pending", "remapped_rows"]
    return _per_gpu("gpu_retired_pages", facts, judge, fields)


def check_gpu_xid(facts: Facts, config: HealthConfig) -> list[CheckResult]:
    """XID errors: those in ``xid_critical`` are CRITICAL, others WARNING, ``xid_ignore`` ignored."""

    def judge(gpu: GpuFacts) -> tuple[Status, str]:
        if gpu.xid_errors is None:
            return _not_reported("XID errors", facts.source)
        counted = sorted({x for x in gpu.xid_errors if x not in config.xid_ignore})
        critical = [x for x in counted if x in config.xid_critical]
        if critical:
            return (
                Status.CRITICAL,
                f"XID {', '.join(map(str, critical))} (critical XIDs: {_ints(config.xid_critical)})",
            )
        if counted:
            return Status.WARNING, f"XID {', '.join(map(str, counted))} (not in the critical list)"
        return Status.OK, "no XID errors"

    return _per_gpu("gpu_xid", facts, judge, ["xid_errors"])


def _ints(values: Iterable[int]) -> str:
    return ",".join(str(v) for v in values)


def temperature_limits(gpu: GpuFacts, config: HealthConfig) -> tuple[float, float, str]:
    """(warn at, critical at, how they were chosen) for ``gpu``."""
    if gpu.slowdown_c is None:
        return config.temperature_warning_c, config.temperature_critical_c, "configured limits"
    crit = gpu.slowdown_c
    how = f"slowdown {gpu.slowdown_c:g} C"
    if gpu.shutdown_c is not None and gpu.shutdown_c - config.temperature_margin_c < crit:
        crit = gpu.shutdown_c - config.temperature_margin_c
        how = f"shutdown {gpu.shutdown_c:g} C - margin {config.temperature_margin_c:g}"
    return gpu.slowdown_c - config.temperature_margin_c, crit, how


def check_gpu_temperature(facts: Facts, config: HealthConfig) -> list[CheckResult]:
    """Temperature against the GPU's slowdown/shutdown thresholds (or the configured ones)."""

    def judge(gpu: GpuFacts) -> tuple[Status, str]:
        if gpu.temperature_c is None:
            return _not_reported("temperature", facts.source)
        warn, crit, how = temperature_limits(gpu, config)
        text = f"{gpu.temperature_c:g} C (warning at {warn:g} C, critical at {crit:g} C; {how})"
        return _grade(gpu.temperature_c, warn, crit), text

    return _per_gpu("gpu_temperature", facts, judge, ["temperature_c", "slowdown_c", "shutdown_c"])


def check_gpu_throttle(facts: Facts, config: HealthConfig) -> list[CheckResult]:
    """Active throttle reasons against ``throttle_critical`` / ``throttle_warning``."""

    def judge(gpu: GpuFacts) -> tuple[Status, str]:
        if gpu.throttle_reasons is None:
            return _not_reported("throttle reasons", facts.source)
        active = set(gpu.throttle_reasons)
        for status, listed in (
            (Status.CRITICAL, config.throttle_critical),
            (Status.WARNING, config.throttle_warning),
        ):
            hit = sorted(active & set(listed))
            if hit:
                return status, f"throttled: {', '.join(hit)} (listed as {status.name.lower()})"
        shown = ", ".join(sorted(active)) or "none"
        return Status.OK, f"throttle reasons: {shown}"

    return _per_gpu("gpu_throttle", facts, judge, ["throttle_reasons"])


def check_gpu_pcie_link(facts: Facts, config: HealthConfig) -> list[CheckResult]:
    """PCIe link width and generation against their maximum."""
    width_status = Status.from_word(config.pcie_width_status)
    gen_status = Status.from_word(config.pcie_gen_status)

    def judge(gpu: GpuFacts) -> tuple[Status, str]:
        if gpu.pcie_width is None and gpu.pcie_gen is None:
            return _not_reported("PCIe link", facts.source)
        findings: list[tuple[Status, str]] = []
        width, width_max = gpu.pcie_width, gpu.pcie_width_max
        if width is not None and width_max is not None and width < width_max:
            findings.append(
                (width_status, f"width x{gpu.pcie_width} below its maximum x{gpu.pcie_width_max}")
            )
        gen, gen_max = gpu.pcie_gen, gpu.pcie_gen_max
        if gen is not None and gen_max is not None and gen < gen_max:
            findings.append((gen_status, f"gen {gpu.pcie_gen} below its maximum gen {gpu.pcie_gen_max}"))
        if not findings:
            return (
                Status.OK,
                f"PCIe gen {gpu.pcie_gen}/{gpu.pcie_gen_max} x{gpu.pcie_width}/x{gpu.pcie_width_max}",
            )
        status = max((s for s, _ in findings), key=lambda s: s.severity)
        return status, "PCIe " + "; ".join(text for _, text in findings)

    return _per_gpu("gpu_pcie_link", facts, judge, ["pcie_gen", "pcie_width"])


def check_gpu_nvlink_errors(facts: Facts, config: HealthConfig) -> list[CheckResult]:
    """Sum of a GPU's NVLink error counters against ``nvlink_errors_warning`` / ``_critical``."""
    warn, crit = config.nvlink_errors_warning, config.nvlink_errors_critical

    def judge(gpu: GpuFacts) -> tuple[Status, str]:
        if gpu.nvlink_errors is None:
            return _not_reported("NVLink error counters", facts.source)
        total = sum(c.value for c in gpu.nvlink_errors)
        worst_links = sorted({c.link for c in gpu.nvlink_errors if c.value})
        where = f" on link(s) {_ints(worst_links)}" if worst_links else ""
        text = f"{total} NVLink error(s){where} (warning at {warn or 'off'}, critical at {crit or 'off'})"
        return _grade(total, warn, crit), text

    return _per_gpu("gpu_nvlink_errors", facts, judge, ["nvlink_errors"])


def check_host_memory(facts: Facts, config: HealthConfig) -> list[CheckResult]:
    """Available memory (share of total) and, when set, the total against ``memory_total_min_mb``."""
    name = "host_memory"
    host = facts.host
    if host is None or host.memory_total_mb is None or host.memory_available_mb is None:
        why = host.error if host is not None and host.error else "host facts were not gathered"
        return [CheckResult(name, Status.UNKNOWN, f"memory unknown: {why}")]
    results = []
    if config.memory_total_min_mb and host.memory_total_mb < config.memory_total_min_mb:
        results.append(
            CheckResult(
                name,
                Status.CRITICAL,
                f"total memory {host.memory_total_mb:.0f} MB below {config.memory_total_min_mb:g} MB",
            )
        )
    pct = 100.0 * host.memory_available_mb / host.memory_total_mb if host.memory_total_mb else 0.0
    warn, crit = config.memory_available_warning_pct, config.memory_available_critical_pct
    status = _grade_low(pct, warn, crit)
    results.append(
        CheckResult(
            name,
            status,
            f"{pct:.1f}% of {host.memory_total_mb:.0f} MB available "
            f"(warning below {warn:g}%, critical below {crit:g}%)",
        )
    )
    return results


def _judge_disk(disk: DiskFacts, config: HealthConfig) -> CheckResult:
    name = "host_disk"
    if disk.free_mb is None:
        return CheckResult(name, Status.UNKNOWN, f"{disk.path}: free space unknown: {disk.error}")
    warn, crit = config.disk_free_warning_mb, config.disk_free_critical_mb
    status = _grade_low(disk.free_mb, warn, crit)
    return CheckResult(
        name,
        status,
        f"{disk.path}: {disk.free_mb:.0f} MB free (warning below {warn:g} MB, critical below {crit:g} MB)",
    )


def check_host_disk(facts: Facts, config: HealthConfig) -> list[CheckResult]:
    """Free space of every configured path against ``disk_free_warning_mb`` / ``_critical_mb``."""
    if facts.host is None:
        return [CheckResult("host_disk", Status.UNKNOWN, "disk space unknown: host facts were not gathered")]
    return [_judge_disk(disk, config) for disk in facts.host.disks]


#: Every check, in the order they are reported.
CHECKS: tuple[Check, ...] = (
    check_gpu_count,
    check_gpu_ecc_uncorrected,
    check_gpu_ecc_corrected_rate,
    check_gpu_retired_pages,
    check_gpu_xid,
    check_gpu_temperature,
    check_gpu_throttle,
    check_gpu_pcie_link,
    check_gpu_nvlink_errors,
    check_host_memory,
    check_host_disk,
)


def run_checks(facts: Facts, config: HealthConfig, checks: Sequence[Check] = CHECKS) -> list[CheckResult]:
    """Every check on the same facts. A check that raises is a bug: it becomes UNKNOWN, not a crash."""
    results: list[CheckResult] = []
    for check in checks:
        name = check.__name__.removeprefix("check_")
        try:
            results.extend(check(facts, config))
        except Exception as err:  # a bug in a check must not make the node look bad
            results.append(CheckResult(name, Status.UNKNOWN, f"the check raised {type(err).__name__}: {err}"))
    return results
