"""Every check on built facts: OK / WARNING / CRITICAL at the boundaries, UNKNOWN when a query failed."""

from __future__ import annotations

import pytest

from torchpass_slurm.health.checks import (
    CHECKS,
    Status,
    check_gpu_count,
    check_gpu_ecc_corrected_rate,
    check_gpu_ecc_uncorrected,
    check_gpu_nvlink_errors,
    check_gpu_pcie_link,
    check_gpu_retired_pages,
    check_gpu_temperature,
    check_gpu_throttle,
    check_gpu_xid,
    check_host_disk,
    check_host_memory,
    run_checks,
    worst,
)
from torchpass_slurm.health.facts import DiskFacts, EccSample, NvlinkCounter

from .conftest import NOW, config, facts, gpu, host


def statuses(results: list) -> list[Status]:  # type: ignore[type-arg]
    return [r.status for r in results]


@pytest.mark.parametrize(
    ("found", "expected", "status"),
    [(4, 4, Status.OK), (5, 4, Status.OK), (3, 4, Status.CRITICAL), (0, 0, Status.OK)],
)
def test_gpu_count(found: int, expected: int, status: Status) -> None:
    results = check_gpu_count(facts([gpu(i) for i in range(found)]), config(expected_gpus=expected))
    assert statuses(results) == [status]
    if expected:
        assert results[0].message == f"{found} GPU(s) working, expected {expected}"


def test_gpu_count_lost_gpu_is_critical() -> None:
    results = check_gpu_count(facts([gpu(0), gpu(1, lost=True)]), config(expected_gpus=2))
    assert [(r.status, r.gpu, r.message) for r in results] == [
        (Status.CRITICAL, 1, "GPU 1 is lost (fell off the bus)"),
        (Status.CRITICAL, None, "1 GPU(s) working, expected 2"),
    ]


def test_gpu_count_without_source() -> None:
    broken = facts(None, gpu_error="NVML did not initialise")
    assert statuses(check_gpu_count(broken, config(expected_gpus=4))) == [Status.UNKNOWN]
    assert statuses(check_gpu_count(broken, config(expected_gpus=0))) == [Status.OK]


@pytest.mark.parametrize(("count", "status"), [(0, Status.OK), (1, Status.CRITICAL), (7, Status.CRITICAL)])
def test_ecc_uncorrected(count: int, status: Status) -> None:
    [result] = check_gpu_ecc_uncorrected(facts([gpu(ecc_uncorrected=count)]), config())
    assert result.status == status
    assert result.message == f"GPU 0: {count} uncorrected ECC error(s) (critical at 1)"


def rate_facts(before: int, after: int, seconds: float):  # type: ignore[no-untyped-def]
    previous = {"GPU-0": EccSample("GPU-0", before, NOW - seconds)}
    return facts([gpu(ecc_corrected=after)], previous_ecc=previous)


@pytest.mark.parametrize(
    ("added", "status"),
    [(99, Status.OK), (100, Status.WARNING), (999, Status.WARNING), (1000, Status.CRITICAL)],
)
def test_ecc_corrected_rate_boundaries(added: int, status: Status) -> None:
    [result] = check_gpu_ecc_corrected_rate(rate_facts(10, 10 + added, 3600), config())
    assert result.status == status
    assert result.message == (
        f"GPU 0: corrected ECC rate {added:.1f}/h (warning at 100/h, critical at 1000/h)"
    )


def test_ecc_rate_needs_an_old_enough_sample() -> None:
    for f in (facts([gpu()]), rate_facts(10, 5000, 30), rate_facts(500, 10, 3600)):  # none, too recent, reset
        [result] = check_gpu_ecc_corrected_rate(f, config())
        assert result.status == Status.OK
        assert "no earlier sample" in result.message


def test_retired_pages() -> None:
    cases = [
        (gpu(), Status.OK, "GPU 0: 0 retired pages (critical at 60), nothing pending"),
        (gpu(retired_pages=60), Status.CRITICAL, "GPU 0: 60 retired pages (critical at 60)"),
        (
            gpu(retired_pages_pending=True),
            Status.WARNING,
            "GPU 0: page retirement or row remap pending (needs a GPU reset)",
        ),
        (
            gpu(remapped_rows_pending=True),
            Status.WARNING,
            "GPU 0: page retirement or row remap pending (needs a GPU reset)",
        ),
        (gpu(remapped_rows_failure=True), Status.CRITICAL, "GPU 0: row remapping failed"),
    ]
    for g, status, message in cases:
        [result] = check_gpu_retired_pages(facts([g]), config())
        assert (result.status, result.message) == (status, message)
    [pending] = check_gpu_retired_pages(
        facts([gpu(retired_pages_pending=True)]), config(retired_pages_pending_status="critical")
    )
    assert pending.status == Status.CRITICAL


@pytest.mark.parametrize(
    ("xids", "status", "message"),
    [
        ((), Status.OK, "GPU 0: no XID errors"),
        ((13, 31), Status.OK, "GPU 0: no XID errors"),
        ((13, 57), Status.WARNING, "GPU 0: XID 57 (not in the critical list)"),
        ((79, 57), Status.CRITICAL, "GPU 0: XID 79 (critical XIDs: 48,61,62,63,64,74,79,92,94,95,119,120)"),
        (None, Status.OK, "GPU 0: XID errors not reported by the simulated source; skipped"),
    ],
)
def test_xid(xids, status, message) -> None:  # type: ignore[no-untyped-def]
    [result] = check_gpu_xid(facts([gpu(xid_errors=xids)]), config())
    assert (result.status, result.message) == (status, message)


@pytest.mark.parametrize(
    ("temp", "status"),
    [(82.9, Status.OK), (83, Status.WARNING), (87.9, Status.WARNING), (88, Status.CRITICAL)],
)
def test_temperature_against_slowdown(temp: float, status: Status) -> None:
    [result] = check_gpu_temperature(facts([gpu(temperature_c=temp)]), config())
    assert result.status == status
    assert result.message == f"GPU 0: {temp:g} C (warning at 83 C, critical at 88 C; slowdown 88 C)"


def test_temperature_near_shutdown_and_without_thresholds() -> None:
    [near] = check_gpu_temperature(facts([gpu(temperature_c=90, slowdown_c=93, shutdown_c=95)]), config())
    assert (near.status, near.message) == (
        Status.CRITICAL,
        "GPU 0: 90 C (warning at 88 C, critical at 90 C; shutdown 95 C - margin 5)",
    )
    [plain] = check_gpu_temperature(
        facts([gpu(temperature_c=85, slowdown_c=None, shutdown_c=None)]), config()
    )
    assert (plain.status, plain.message) == (
        Status.WARNING,
        "GPU 0: 85 C (warning at 83 C, critical at 90 C; configured limits)",
    )


def test_throttle() -> None:
    def judge(reasons, **settings):  # type: ignore[no-untyped-def]
        [result] = check_gpu_throttle(facts([gpu(throttle_reasons=reasons)]), config(**settings))
        return result.status, result.message

    assert judge(("gpu_idle", "sw_power_cap")) == (
        Status.OK,
        "GPU 0: throttle reasons: gpu_idle, sw_power_cap",
    )
    assert judge(("hw_slowdown",)) == (Status.WARNING, "GPU 0: throttled: hw_slowdown (listed as warning)")
    assert judge(("hw_slowdown",), throttle_critical=("hw_slowdown",)) == (
        Status.CRITICAL,
        "GPU 0: throttled: hw_slowdown (listed as critical)",
    )


def test_pcie_link() -> None:
    [narrow] = check_gpu_pcie_link(facts([gpu(pcie_width=8)]), config())
    assert (narrow.status, narrow.message) == (Status.WARNING, "GPU 0: PCIe width x8 below its maximum x16")
    [slow] = check_gpu_pcie_link(facts([gpu(pcie_gen=1)]), config())
    assert slow.status == Status.OK  # idle GPUs lower their generation
    [slow_counted] = check_gpu_pcie_link(
        facts([gpu(pcie_gen=1, pcie_width=8)]), config(pcie_gen_status="critical")
    )
    assert (slow_counted.status, slow_counted.message) == (
        Status.CRITICAL,
        "GPU 0: PCIe width x8 below its maximum x16; gen 1 below its maximum gen 5",
    )


@pytest.mark.parametrize(
    ("total", "status"), [(99, Status.OK), (100, Status.WARNING), (5000, Status.CRITICAL)]
)
def test_nvlink_errors(total: int, status: Status) -> None:
    counters = (
        NvlinkCounter(0, "replay", total - 1),
        NvlinkCounter(3, "crc_flit", 1),
        NvlinkCounter(1, "replay", 0),
    )
    [result] = check_gpu_nvlink_errors(
        facts([gpu(nvlink_errors=counters)]), config(nvlink_errors_critical=5000)
    )
    assert result.status == status
    assert (
        result.message == f"GPU 0: {total} NVLink error(s) on link(s) 0,3 (warning at 100, critical at 5000)"
    )


@pytest.mark.parametrize(
    ("available", "status"), [(10_000, Status.OK), (9_999, Status.WARNING), (2_999, Status.CRITICAL)]
)
def test_host_memory(available: float, status: Status) -> None:
    [result] = check_host_memory(facts(host=host(memory_available_mb=available)), config())
    assert result.status == status
    pct = available / 1000
    assert result.message == f"{pct:.1f}% of 100000 MB available (warning below 10%, critical below 3%)"


def test_host_memory_total_and_unknown() -> None:
    results = check_host_memory(facts(), config(memory_total_min_mb=200_000))
    assert statuses(results) == [Status.CRITICAL, Status.OK]
    assert results[0].message == "total memory 100000 MB below 200000 MB"
    [unknown] = check_host_memory(
        facts(host=host(memory_total_mb=None, error="cannot read /proc/meminfo")), config()
    )
    assert (unknown.status, unknown.message) == (Status.UNKNOWN, "memory unknown: cannot read /proc/meminfo")


def test_host_disk() -> None:
    disks = (
        DiskFacts("/a", free_mb=5000),
        DiskFacts("/b", free_mb=1000),
        DiskFacts("/c", free_mb=100),
        DiskFacts("/d", error="No such file or directory"),
    )
    results = check_host_disk(facts(host=host(disks=disks)), config())
    assert [(r.status, r.message) for r in results] == [
        (Status.OK, "/a: 5000 MB free (warning below 2048 MB, critical below 512 MB)"),
        (Status.WARNING, "/b: 1000 MB free (warning below 2048 MB, critical below 512 MB)"),
        (Status.CRITICAL, "/c: 100 MB free (warning below 2048 MB, critical below 512 MB)"),
        (Status.UNKNOWN, "/d: free space unknown: No such file or directory"),
    ]


def test_failed_query_is_unknown_never_critical() -> None:
    broken = gpu(ecc_uncorrected=None, errors=(("ecc_uncorrected", "NVMLError_Unknown: Unknown Error"),))
    [result] = check_gpu_ecc_uncorrected(facts([broken]), config())
    assert (result.status, result.message) == (
        Status.UNKNOWN,
        "GPU 0: query failed: NVMLError_Unknown: Unknown Error",
    )


def test_no_device_facts_make_every_gpu_check_unknown() -> None:
    results = run_checks(facts(None, gpu_error="the simulated library is broken"), config(expected_gpus=2))
    gpu_results = [r for r in results if r.check.startswith("gpu_")]
    assert len(gpu_results) == 9
    assert {r.status for r in gpu_results} == {Status.UNKNOWN}
    assert worst(results) == Status.UNKNOWN


def test_worst_orders_critical_over_unknown() -> None:
    results = run_checks(facts([gpu(0, lost=True)], host=None), config(expected_gpus=1))
    assert {Status.CRITICAL, Status.UNKNOWN} <= set(statuses(results))
    assert worst(results) == Status.CRITICAL
    assert worst([]) == Status.OK


def test_a_check_that_raises_is_unknown() -> None:
    def check_gpu_buggy(f, c):  # type: ignore[no-untyped-def]
        raise ZeroDivisionError("oops")

    [result] = run_checks(facts(), config(), [check_gpu_buggy])
    assert (result.check, result.status, result.message) == (
        "gpu_buggy",
        Status.UNKNOWN,
        "the check raised ZeroDivisionError: oops",
    )


def test_every_check_is_named_check_area_thing() -> None:
    assert all(c.__name__.startswith(("check_gpu_", "check_host_")) for c in CHECKS)
    assert len(CHECKS) == 11
