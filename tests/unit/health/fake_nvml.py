"""A pynvml that replays recorded NVML answers (tests/fixtures/nvml/*.json).

A fixture names, per GPU, the answers to each read in order (the last one
repeats), and the answers to the event waits in order (then every wait times
out, as ``nvmlEventSetWait_v2`` does: NVML_ERROR_TIMEOUT). An answer is a value,
``{"error": CODE}`` (the call raises NVMLError(CODE)) or ``{"raise": "TypeError"}``
(a broken binding raises something else). Constants, return codes and the
shapes of ``c_nvmlEventData_t`` and ``c_nvmlFieldValue_t`` are nvidia-ml-py's.
Any other call fails the test: the waiter must use only what is recorded.
"""

from __future__ import annotations

import builtins
import json
import types
from pathlib import Path
from typing import Any

import pytest

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "nvml"

#: pynvml's constants that the waiter reads (nvidia-ml-py 13.615.71).
CONSTANTS = {
    "NVML_SUCCESS": 0,
    "NVML_ERROR_NOT_SUPPORTED": 3,
    "NVML_ERROR_TIMEOUT": 10,
    "NVML_ERROR_LIBRARY_NOT_FOUND": 12,
    "NVML_ERROR_GPU_IS_LOST": 15,
    "NVML_ERROR_UNKNOWN": 999,
    "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION": 230,
    "NVML_MEMORY_ERROR_TYPE_UNCORRECTED": 1,
    "NVML_VOLATILE_ECC": 0,
    "nvmlEventTypeSingleBitEccError": 0x1,
    "nvmlEventTypeDoubleBitEccError": 0x2,
    "nvmlEventTypeXidCriticalError": 0x8,
    "nvmlEventTypeGpuRecoveryAction": 0x8000,
}
_VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


class NVMLError(Exception):
    """pynvml's NVMLError: ``value`` is the NVML return code."""

    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class Handle:
    """An opaque ``c_nvmlDevice_t``."""

    def __init__(self, index: int) -> None:
        self.index = index


def _answer(answer: Any) -> Any:
    if isinstance(answer, dict) and "error" in answer:
        raise NVMLError(answer["error"])
    if isinstance(answer, dict) and "raise" in answer:
        raise getattr(builtins, answer["raise"])(f"recorded {answer['raise']}")
    return answer


class FakeNvml(types.ModuleType):
    """The replaying module; ``calls`` records what changes NVML's state."""

    def __init__(self, doc: dict[str, Any]) -> None:
        super().__init__("pynvml")
        for name, value in CONSTANTS.items():
            setattr(self, name, value)
        self.NVMLError = NVMLError
        self.doc = doc
        self.calls: list[tuple[Any, ...]] = []
        self._queues: dict[tuple[int, str], list[Any]] = {}
        self._waits = list(doc.get("waits", []))

    def __getattr__(self, name: str) -> Any:
        pytest.fail(f"FakeNvml: unexpected call pynvml.{name}")

    def _next(self, gpu: int, key: str) -> Any:
        queue = self._queues.setdefault((gpu, key), list(self.doc["gpus"][gpu][key]))
        return _answer(queue.pop(0) if len(queue) > 1 else queue[0])

    # -- library ---------------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        self.calls.append(("init",))
        _answer(self.doc.get("init"))

    def nvmlShutdown(self) -> None:
        self.calls.append(("shutdown",))

    def nvmlDeviceGetCount(self) -> int:
        return len(self.doc["gpus"])

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Handle:
        return Handle(index)

    def nvmlDeviceGetIndex(self, handle: Handle) -> int:
        return handle.index

    # -- events ----------------------------------------------------------------------------------
    def nvmlEventSetCreate(self) -> str:
        self.calls.append(("create",))
        return str(_answer(self.doc.get("event_set_create", "set-1")))

    def nvmlDeviceGetSupportedEventTypes(self, handle: Handle) -> int:
        return int(self._next(handle.index, "supported_event_types"))

    def nvmlDeviceRegisterEvents(self, handle: Handle, mask: int, event_set: str) -> None:
        self.calls.append(("register", handle.index, mask, event_set))

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> Any:
        assert isinstance(timeout_ms, int) and 0 < timeout_ms <= 1000, timeout_ms
        if not self._waits:
            raise NVMLError(10)  # NVML_ERROR_TIMEOUT: nothing happened
        event = _answer(self._waits.pop(0))
        return types.SimpleNamespace(
            device=Handle(event["device"]),
            eventType=event["eventType"],
            eventData=event["eventData"],
            gpuInstanceId=0xFFFFFFFF,
            computeInstanceId=0xFFFFFFFF,
        )

    def nvmlEventSetFree(self, event_set: str) -> None:
        self.calls.append(("free", event_set))

    # -- reads -----------------------------------------------------------------------------------
    def nvmlDeviceGetFieldValues(self, handle: Handle, field_ids: list[int]) -> list[Any]:
        assert field_ids == [230]
        recorded = self._next(handle.index, "field_230")
        value = types.SimpleNamespace(**{_VALUE_MEMBER[recorded["valueType"]]: recorded["value"]})
        return [
            types.SimpleNamespace(
                fieldId=230,
                scopeId=0,
                timestamp=0,
                latencyUsec=0,
                valueType=recorded["valueType"],
                nvmlReturn=recorded["nvmlReturn"],
                value=value,
            )
        ]

    def nvmlDeviceGetTotalEccErrors(self, handle: Handle, error_type: int, counter_type: int) -> int:
        assert (error_type, counter_type) == (1, 0)  # uncorrected, volatile
        return int(self._next(handle.index, "ecc_uncorrected_volatile"))

    def nvmlDeviceGetRemappedRows(self, handle: Handle) -> tuple[int, int, int, int]:
        corrected, uncorrected, pending, failure = self._next(handle.index, "remapped_rows")
        return corrected, uncorrected, pending, failure

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Handle) -> int:
        return int(self._next(handle.index, "clocks_event_reasons"))


def load(name: str) -> FakeNvml:
    """The fake pynvml replaying ``tests/fixtures/nvml/NAME.json``."""
    return FakeNvml(json.loads((FIXTURES / f"{name}.json").read_text()))
