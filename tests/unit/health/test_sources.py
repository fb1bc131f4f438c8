"""Device sources: the simulated file, and NVML / AMD SMI through fake modules."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from torchpass_slurm.errors import ConfigError, SourceError
from torchpass_slurm.health.config import HealthConfig
from torchpass_slurm.health.facts import NvlinkCounter
from torchpass_slurm.health.sources import NoGpuSource, select_source
from torchpass_slurm.health.sources.amdsmi import AmdSmiSource
from torchpass_slurm.health.sources.nvml import NvmlSource
from torchpass_slurm.health.sources.simulated import SimulatedSource

from .conftest import Sim, sim_gpu


def test_simulated_source_reads_every_field(sim: Sim) -> None:
    sim.gpus(
        sim_gpu(
            0,
            xid_errors=[79],
            nvlink_errors=[{"link": 2, "counter": "replay", "value": 5}],
            errors={"pcie_gen": "boom"},
        ),
        {"index": 1, "lost": True},
    )
    first, second = SimulatedSource(sim.devices).gpus()
    assert (first.xid_errors, first.nvlink_errors, first.errors) == (
        (79,),
        (NvlinkCounter(2, "replay", 5),),
        (("pcie_gen", "boom"),),
    )
    assert (second.uuid, second.lost, second.temperature_c) == ("SIM-GPU-1", True, None)


def test_simulated_source_errors(sim: Sim) -> None:
    sim.write({"broken": "NVML_ERROR_LIB_RM_VERSION_MISMATCH"})
    with pytest.raises(
        SourceError, match="the simulated library is broken: NVML_ERROR_LIB_RM_VERSION_MISMATCH"
    ):
        SimulatedSource(sim.devices).gpus()
    sim.gpus({"index": 0, "temprature_c": 3})
    with pytest.raises(SourceError, match=r"gpus\[0\] has unknown field\(s\) temprature_c"):
        SimulatedSource(sim.devices).gpus()
    with pytest.raises(SourceError, match="cannot read the simulated devices file"):
        SimulatedSource(sim.root / "missing.json").gpus()


@pytest.mark.parametrize(
    ("gpu", "message"),
    [
        ({"index": 0, "lost": "no"}, r"gpus\[0\]\.lost is 'no'; expected bool"),
        ({"index": 0, "ecc_corrected": "12"}, r"gpus\[0\]\.ecc_corrected is '12'; expected int"),
        ({"index": 0, "ecc_uncorrected": True}, r"gpus\[0\]\.ecc_uncorrected is True; expected int"),
        ({"index": 0, "temperature_c": [90]}, r"gpus\[0\]\.temperature_c is \[90\]; expected int or float"),
        ({"index": "0"}, r"gpus\[0\]\.index is '0'; expected int"),
    ],
    ids=["lost-as-text", "ecc-as-text", "ecc-as-bool", "temperature-as-list", "index-as-text"],
)
def test_simulated_source_type_checks_its_file(sim: Sim, gpu: dict[str, Any], message: str) -> None:
    """A mistyped fact is the file's mistake, said so: never a GPU that looks lost or failing."""
    sim.gpus(gpu)
    with pytest.raises(SourceError, match=message):
        SimulatedSource(sim.devices).gpus()


def test_select_source(sim: Sim, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(select_source(HealthConfig()), SimulatedSource)  # auto + TORCHPASS_HEALTH_SIMULATE
    assert isinstance(select_source(HealthConfig(), "nvml"), NvmlSource)
    assert isinstance(select_source(HealthConfig(), "amdsmi"), AmdSmiSource)
    monkeypatch.delenv("TORCHPASS_HEALTH_SIMULATE")
    monkeypatch.setattr("torchpass_slurm.health.sources._importable", lambda name: False)
    assert isinstance(select_source(HealthConfig()), NoGpuSource)
    with pytest.raises(ConfigError, match="the simulated source needs a file"):
        select_source(HealthConfig(), "simulated")
    with pytest.raises(SourceError, match="no GPU library found"):
        NoGpuSource().gpus()


class NVMLError(Exception):
    """pynvml's error: ``value`` is the NVML return code."""

    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


def fake_pynvml(
    *,
    init_error: int | None = None,
    lost: set[int] = frozenset(),  # type: ignore[assignment]
    unsupported: set[str] = frozenset(),
    failing: dict[str, int] | None = None,
) -> types.ModuleType:  # type: ignore[assignment]
    """A pynvml with two GPUs; any call can be made to fail with an NVML code."""
    failing = failing or {}
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = NVMLError  # type: ignore[attr-defined]
    nvml.shutdowns = []  # type: ignore[attr-defined]

    def call(name: str, value: Any) -> Any:
        def fn(*args: Any) -> Any:
            if name in unsupported:
                raise NVMLError(3)
            if name in failing:
                raise NVMLError(failing[name])
            return value(*args) if callable(value) else value

        return fn

    def init() -> None:
        if init_error is not None:
            raise NVMLError(init_error)

    def handle(index: int) -> str:
        if index in lost:
            raise NVMLError(15)
        return f"h{index}"

    answers: dict[str, Any] = {
        "nvmlDeviceGetCount": 2,
        "nvmlDeviceGetUUID": lambda h: f"GPU-{h}".encode(),
        "nvmlDeviceGetName": b"NVIDIA H100",
        "nvmlDeviceGetTemperature": 61,
        "nvmlDeviceGetTemperatureThreshold": lambda h, kind: {1: 88, 0: 95}[kind],
        "nvmlDeviceGetTotalEccErrors": lambda h, kind, counter: {0: 12, 1: 0}[kind],
        "nvmlDeviceGetRetiredPages": lambda h, cause: [0x1000] * cause,
        "nvmlDeviceGetRetiredPagesPendingStatus": 0,
        "nvmlDeviceGetRemappedRows": (0, 0, 1, 0),
        "nvmlDeviceGetCurrentClocksEventReasons": 0x1 | 0x8,
        "nvmlDeviceGetCurrPcieLinkGeneration": 4,
        "nvmlDeviceGetMaxPcieLinkGeneration": 5,
        "nvmlDeviceGetCurrPcieLinkWidth": 16,
        "nvmlDeviceGetMaxPcieLinkWidth": 16,
        "nvmlDeviceGetNvLinkState": lambda h, link: 1 if link < 2 else (_ for _ in ()).throw(NVMLError(2)),
        "nvmlDeviceGetNvLinkErrorCounter": lambda h, link, counter: link * 10 + counter,
    }
    for name, value in answers.items():
        setattr(nvml, name, call(name, value))
    nvml.nvmlInit = init  # type: ignore[attr-defined]
    nvml.nvmlShutdown = lambda: nvml.shutdowns.append(True)  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetHandleByIndex = call("nvmlDeviceGetHandleByIndex", handle)  # type: ignore[attr-defined]
    return nvml


def test_nvml_source_reads_a_healthy_gpu() -> None:
    nvml = fake_pynvml()
    first, _second = NvmlSource(nvml).gpus()
    assert (first.uuid, first.name, first.temperature_c, first.slowdown_c, first.shutdown_c) == (
        "GPU-h0",
        "NVIDIA H100",
        61,
        88,
        95,
    )
    assert (first.ecc_corrected, first.ecc_uncorrected, first.retired_pages) == (12, 0, 1)
    assert (first.retired_pages_pending, first.remapped_rows_pending, first.remapped_rows_failure) == (
        False,
        True,
        False,
    )
    assert first.throttle_reasons == ("gpu_idle", "hw_slowdown")
    assert (first.pcie_gen, first.pcie_gen_max, first.pcie_width, first.pcie_width_max) == (4, 5, 16, 16)
    assert first.nvlink_errors is not None and len(first.nvlink_errors) == 8
    assert first.nvlink_errors[-1] == NvlinkCounter(1, "crc_data", 13)
    assert (first.xid_errors, first.errors, first.lost) == (None, (), False)
    assert nvml.shutdowns == [True]  # type: ignore[attr-defined]


def test_nvml_init_failure_is_a_source_error() -> None:
    nvml = fake_pynvml(init_error=18)  # NVML_ERROR_LIB_RM_VERSION_MISMATCH
    with pytest.raises(SourceError, match="NVML did not initialise: NVMLError: NVML error 18"):
        NvmlSource(nvml).gpus()


def test_nvml_lost_unsupported_and_failing_queries() -> None:
    nvml = fake_pynvml(
        lost={1}, unsupported={"nvmlDeviceGetRemappedRows"}, failing={"nvmlDeviceGetTemperature": 999}
    )
    first, second = NvmlSource(nvml).gpus()
    assert second.lost and second.uuid == "index-1"
    assert (first.remapped_rows_pending, first.remapped_rows_failure) == (None, None)
    assert first.temperature_c is None
    assert first.errors == (("temperature_c", "NVMLError: NVML error 999"),)


def test_nvml_missing_library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    with pytest.raises(SourceError, match="pynvml does not import"):
        NvmlSource().gpus()


def test_a_library_exiting_at_import_is_a_source_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def exits(name: str) -> types.ModuleType:
        raise SystemExit(2)  # as a binding does that calls sys.exit() when its shared library is missing

    monkeypatch.setattr("torchpass_slurm.health.sources.importlib.import_module", exits)
    with pytest.raises(SourceError, match="amdsmi does not import: SystemExit: 2"):
        AmdSmiSource().gpus()


def test_a_binding_without_its_error_class_is_a_source_error() -> None:
    nvml = fake_pynvml()
    del nvml.NVMLError  # type: ignore[attr-defined]
    with pytest.raises(SourceError, match="pynvml has no exception class NVMLError"):
        NvmlSource(nvml).gpus()


def test_a_bug_in_a_query_is_not_taken_for_an_nvml_error() -> None:
    nvml = fake_pynvml()
    nvml.nvmlDeviceGetCount = lambda: "two"  # type: ignore[attr-defined]
    with pytest.raises(ValueError):
        NvmlSource(nvml).gpus()
    assert nvml.shutdowns == [True]  # type: ignore[attr-defined]


def test_amdsmi_source() -> None:
    smi = types.ModuleType("amdsmi")
    smi.AmdSmiException = RuntimeError  # type: ignore[attr-defined]  # what this fake's calls raise
    smi.amdsmi_init = lambda: None  # type: ignore[attr-defined]
    smi.amdsmi_shut_down = lambda: None  # type: ignore[attr-defined]
    smi.amdsmi_get_processor_handles = lambda: ["a0"]  # type: ignore[attr-defined]
    smi.amdsmi_get_gpu_device_uuid = lambda h: "AMD-0"  # type: ignore[attr-defined]
    smi.amdsmi_get_temp_metric = lambda h, kind, metric: {0: 70, 4: 100, 6: 105}[metric]  # type: ignore[attr-defined]
    smi.amdsmi_get_gpu_total_ecc_count = lambda h: {"correctable_count": 3, "uncorrectable_count": 1}  # type: ignore[attr-defined]
    smi.amdsmi_get_gpu_bad_page_info = lambda h: [{"status": "AmdSmiMemoryPageStatus.PENDING"}]  # type: ignore[attr-defined]
    smi.amdsmi_get_pcie_info = lambda h: {  # type: ignore[attr-defined]
        "pcie_static": {"max_pcie_width": 16, "max_pcie_speed": 32000},
        "pcie_metric": {"pcie_width": 8, "pcie_speed": 16000},
    }

    def xgmi(h: str) -> int:
        raise RuntimeError("xgmi query failed")

    smi.amdsmi_gpu_xgmi_error_status = xgmi  # type: ignore[attr-defined]
    [gpu] = AmdSmiSource(smi).gpus()
    assert (gpu.uuid, gpu.temperature_c, gpu.slowdown_c, gpu.shutdown_c) == ("AMD-0", 70, 100, 105)
    assert (gpu.ecc_corrected, gpu.ecc_uncorrected, gpu.retired_pages, gpu.retired_pages_pending) == (
        3,
        1,
        1,
        True,
    )
    assert (gpu.pcie_gen, gpu.pcie_gen_max, gpu.pcie_width, gpu.pcie_width_max) == (4, 5, 8, 16)
    assert gpu.errors == (("nvlink_errors", "RuntimeError: xgmi query failed"),)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"hang_s": "30"}, "hang_s is '30'; expected a number of seconds"),
        ({"hang_s": True}, "hang_s is True; expected a number of seconds"),
        ({"broken": True}, r"broken is True; expected a string \(the error the library reports\)"),
        ({"gpus": {"index": 0}}, "gpus is {'index': 0}; expected a list of GPU objects"),
        ({"gpu": []}, r"unknown key\(s\) gpu"),
    ],
)
def test_simulated_source_type_checks_its_top_level_keys(sim: Sim, doc: dict[str, Any], message: str) -> None:
    sim.write(doc)
    with pytest.raises(SourceError, match=message):
        SimulatedSource(sim.devices).gpus()
