"""The per-node waiter on NVML events: GPU signals as they happen, judged by :mod:`.gpu_signals`.

:class:`NvmlEventWaiter` is a daemon thread (started by the in-job health
agent, :mod:`torchpass_slurm.rank.health_agent`)::

    open    nvmlInit; a handle per GPU; nvmlEventSetCreate; nvmlDeviceRegisterEvents(handle,
            NVML_EVENTS & nvmlDeviceGetSupportedEventTypes(handle), set) for each GPU
    loop    nvmlEventSetWait_v2(set, WAIT_TIMEOUT_MS)      bounded: close() is seen within it
              an event      -> judge_event (an XID by its code, others by type), then read every GPU
              timeout       -> nothing; every ``interval`` s read every GPU anyway
    read    field 230 (recovery action), the volatile uncorrectable ECC count, remapped rows,
            clock event (throttle) reasons -> judge_reading against the GPU's previous reading
    close   nvmlEventSetFree, nvmlShutdown

Each finding goes to ``on_findings`` once (the same signal on the same GPU is
not repeated). What can go wrong is a finding too, never an exception out of
the thread and never a ``move_now``: pynvml missing or nvmlInit failing is one
``unknown`` finding and the waiter ends; events not supported leaves it
polling; a read that fails is ``unknown`` for that field; an odd error from a
broken binding (a TypeError, an AttributeError of an old one) is ``unknown``.
A GPU that answers ``GPU_IS_LOST`` is the one library error that is a signal.
pynvml is imported in :meth:`NvmlEventWaiter.open`, never at import.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import threading
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from torchpass_slurm.health.facts import THROTTLE_REASONS
from torchpass_slurm.health.gpu_signals import (
    NVML_EVENTS,
    RECOVERY_ACTION_FIELD,
    Finding,
    GpuReading,
    Verdict,
    judge_event,
    judge_reading,
)
from torchpass_slurm.health.sources.nvml import NvmlQueries, describe

logger = logging.getLogger(__name__)

__all__ = ["WAIT_TIMEOUT_MS", "NvmlEventWaiter", "nvml_available", "read_gpu"]

#: Milliseconds one nvmlEventSetWait_v2 blocks: the longest close() waits for the thread.
WAIT_TIMEOUT_MS = 1000

# NVML return codes (pynvml's NVML_ERROR_*), as documented.
_SUCCESS = 0
_NOT_SUPPORTED = 3
_TIMEOUT = 10
_GPU_IS_LOST = 15
# c_nvmlFieldValue_t.valueType -> the member of c_nvmlValue_t that holds the value.
_VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}

OnFindings = Callable[[Sequence[Finding]], None]


def nvml_available() -> bool:
    """pynvml can be found (it is not imported: that is :meth:`NvmlEventWaiter.open`'s)."""
    try:
        return importlib.util.find_spec("pynvml") is not None
    except (ImportError, ValueError):
        return False


def _code(err: BaseException) -> int | None:
    value = getattr(err, "value", None)
    return value if isinstance(value, int) else None


def _field_value(values: Any) -> int | None:
    """The one c_nvmlFieldValue_t of ``values`` as an int; None when NOT_SUPPORTED (driver < r570)."""
    value = values[0]
    ret = int(value.nvmlReturn)
    if ret == _NOT_SUPPORTED:
        return None
    if ret != _SUCCESS:
        raise RuntimeError(f"field {RECOVERY_ACTION_FIELD} answered NVML return code {ret}")
    member = _VALUE_MEMBER.get(int(value.valueType))
    if member is None:
        raise RuntimeError(f"field {RECOVERY_ACTION_FIELD} has value type {value.valueType}")
    return int(getattr(value.value, member))


def read_gpu(nvml: ModuleType, index: int, handle: Any) -> GpuReading:
    """What the waiter reads of one GPU: recovery action, ECC, remapped rows, throttle reasons."""
    q = NvmlQueries(Exception)  # inside the training: any failure is a failed read
    action = q(
        "recovery_action",
        lambda: _field_value(nvml.nvmlDeviceGetFieldValues(handle, [RECOVERY_ACTION_FIELD])),
    )
    ecc = q(
        "ecc_uncorrected",
        nvml.nvmlDeviceGetTotalEccErrors,
        handle,
        getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
        getattr(nvml, "NVML_VOLATILE_ECC", 0),
    )
    rows = q("remapped_rows", nvml.nvmlDeviceGetRemappedRows, handle)
    reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
        nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None
    )
    mask = None if reasons is None else q("throttle_reasons", reasons, handle)
    return GpuReading(
        index=index,
        lost=q.lost,
        recovery_action=None if action is None else int(action),
        ecc_uncorrected=None if ecc is None else int(ecc),
        remapped_rows_pending=None if rows is None else bool(rows[2]),
        remapped_rows_failure=None if rows is None else bool(rows[3]),
        throttle_reasons=None
        if mask is None
        else tuple(name for bit, name in THROTTLE_REASONS.items() if int(mask) & bit),
        errors=tuple(sorted(q.errors.items())),
    )


class NvmlEventWaiter(threading.Thread):
    """Waits on the node's NVML events and reads its GPUs every ``interval`` s; see the module doc.

    ``module`` replaces ``import pynvml`` (tests); ``clock`` is the monotonic clock.
    """

    def __init__(
        self,
        on_findings: OnFindings,
        *,
        interval: float,
        module: ModuleType | None = None,
        wait_ms: int = WAIT_TIMEOUT_MS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(name="torchpass-gpu-events", daemon=True)
        self.on_findings = on_findings
        self.interval = interval
        self.wait_ms = wait_ms
        self.clock = clock
        self.stopping = threading.Event()
        self._module = module
        self._nvml: ModuleType | None = None
        self._handles: dict[int, Any] = {}
        self._event_set: Any = None
        self._wait: Callable[[Any, int], Any] | None = None
        self._previous: dict[int, GpuReading] = {}
        self._seen: set[tuple[int | None, str, Verdict]] = set()
        self._next_read = 0.0

    # -- the thread ----------------------------------------------------------------------------
    def run(self) -> None:
        try:
            if not self.open():
                return
            while not self.stopping.is_set():
                self.step()
        except Exception as err:  # deliberately broad: never hurt the training
            self._emit([Finding(None, "gpu event waiter", Verdict.UNKNOWN, describe(err))])
        finally:
            self.shut()

    def close(self, timeout: float | None = None) -> None:
        """Stop the thread; it ends within one wait (:data:`WAIT_TIMEOUT_MS`) or read."""
        self.stopping.set()
        if self.is_alive():
            self.join(timeout)

    # -- the steps (the tests drive these directly) --------------------------------------------
    def open(self) -> bool:
        """Load pynvml, init, find the GPUs, register for events; False (one unknown) if NVML is unusable."""
        try:
            nvml = self._module or importlib.import_module("pynvml")
            nvml.nvmlInit()
        # Deliberately broad, as the device sources' load_library: a binding fails at import
        # in any way, and none of it says the GPU is bad.
        except (Exception, SystemExit) as err:
            self._emit([Finding(None, "NVML", Verdict.UNKNOWN, f"NVML unusable: {describe(err)}")])
            return False
        self._nvml = nvml
        findings: list[Finding] = []
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except Exception as err:
            self._emit([Finding(None, "NVML", Verdict.UNKNOWN, f"cannot count the GPUs: {describe(err)}")])
            return False
        for index in range(count):
            try:
                self._handles[index] = nvml.nvmlDeviceGetHandleByIndex(index)
            except Exception as err:
                if _code(err) == _GPU_IS_LOST:
                    findings += judge_reading(GpuReading(index, lost=True), None)
                else:
                    findings.append(Finding(index, "read handle", Verdict.UNKNOWN, describe(err)))
        findings += self._register(nvml)
        self._emit(findings)
        return True

    def _register(self, nvml: ModuleType) -> list[Finding]:
        """The event set, registered on every GPU for the types it supports; [] or why it polls only."""
        try:
            self._wait = getattr(nvml, "nvmlEventSetWait_v2", None) or nvml.nvmlEventSetWait
            self._event_set = nvml.nvmlEventSetCreate()
        except Exception as err:
            self._event_set = None
            return [Finding(None, "NVML events", Verdict.UNKNOWN, f"polling only: {describe(err)}")]
        wanted = 0
        for bit in NVML_EVENTS:
            wanted |= bit
        out: list[Finding] = []
        for index, handle in self._handles.items():
            try:
                supported = int(nvml.nvmlDeviceGetSupportedEventTypes(handle))
                if wanted & supported:
                    nvml.nvmlDeviceRegisterEvents(handle, wanted & supported, self._event_set)
            except Exception as err:
                if _code(err) != _NOT_SUPPORTED:
                    out.append(Finding(index, "register events", Verdict.UNKNOWN, describe(err)))
        return out

    def step(self) -> None:
        """One bounded wait for an event (or for the stop), then the periodic read when due."""
        findings: list[Finding] = []
        event = self._wait_event(findings)
        now = self.clock()
        if event or now >= self._next_read:
            self._next_read = now + self.interval
            findings += self.read()
        self._emit(findings)

    def _wait_event(self, findings: list[Finding]) -> bool:
        if self._event_set is None or self._wait is None:
            self.stopping.wait(self.wait_ms / 1000)
            return False
        try:
            data = self._wait(self._event_set, self.wait_ms)
        except Exception as err:
            if _code(err) == _TIMEOUT:
                return False
            findings.append(Finding(None, "wait for events", Verdict.UNKNOWN, describe(err)))
            self.stopping.wait(self.wait_ms / 1000)  # a wait that fails at once must not spin
            return False
        try:
            event_type, event_data = int(data.eventType), int(data.eventData)
        except Exception as err:
            findings.append(Finding(None, "event data", Verdict.UNKNOWN, describe(err)))
            return True
        findings += judge_event(self._index_of(data), event_type, event_data)
        return True

    def _index_of(self, data: Any) -> int | None:
        """The GPU an event came from (nvmlDeviceGetIndex of its device); None if it cannot tell."""
        assert self._nvml is not None
        try:
            return int(self._nvml.nvmlDeviceGetIndex(data.device))
        except Exception:
            return None

    def read(self) -> list[Finding]:
        """Read every GPU and judge it against its previous reading."""
        assert self._nvml is not None
        findings: list[Finding] = []
        for index, handle in self._handles.items():
            reading = read_gpu(self._nvml, index, handle)
            findings += judge_reading(reading, self._previous.get(index))
            self._previous[index] = reading
        return findings

    def shut(self) -> None:
        """Free the event set and shut NVML down (errors logged, never raised)."""
        nvml, self._nvml = self._nvml, None
        if nvml is None:
            return
        try:
            if self._event_set is not None:
                nvml.nvmlEventSetFree(self._event_set)
            nvml.nvmlShutdown()
        except Exception as err:
            logger.debug("NVML shutdown: %s", describe(err))

    def _emit(self, findings: Sequence[Finding]) -> None:
        new = []
        for f in findings:
            key = (f.gpu, f.signal, f.verdict)
            if key not in self._seen:
                self._seen.add(key)
                new.append(f)
        if new:
            self.on_findings(new)
