"""GPU signals as fault signals: one table maps each signal to a :class:`Verdict`. Pure.

A *signal* is one thing a GPU's management library says: an XID code, NVML's
recovery action (field 230), an NVML event, an uncorrectable ECC count, a row
remap, a throttle reason, AMD SMI's event or RAS count. Each row of
:data:`RULES` gives a signal its verdict, with the reason and where the fact
comes from::

    verdict     meaning                                                   what the job does
    move_now    the node is going: move its state now (unplanned)         report CRITICAL
    plan_move   the GPU still works but is failing: move at the next      report WARNING
                safe point (pre-emptive)
    app_fault   the application's own fault (a bad address, a killed      log it, move nothing
                process): the GPU is fine
    none        nothing to do (normal operation, or informational)        nothing
    unknown     the reading itself failed: says nothing about the GPU     log it, move nothing

A signal no row names gets its kind's default (:data:`DEFAULTS`), which says
why. A reading that failed is ``unknown``, never ``move_now``: a broken
library must not move a job.

The facts are from the research notes of the project (NVIDIA's XID catalog as
mirrored by leptonai/gpud; nvidia-ml-py 13.615.71's ``pynvml.py``; amdsmi
7.0.2); a reason that is the project's own judgement says so ("ours").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from torchpass_slurm.health.facts import GpuFacts
from torchpass_slurm.strenum import StrEnum

__all__ = [
    "AMD_EVENTS",
    "DEFAULTS",
    "NVML_EVENTS",
    "RECOVERY_ACTION_FIELD",
    "RULES",
    "Finding",
    "GpuReading",
    "Kind",
    "Rule",
    "Verdict",
    "judge_amd_event",
    "judge_event",
    "judge_reading",
    "judge_recovery_action",
    "judge_xid",
    "reading_from_facts",
    "rule",
    "summary",
    "worst",
]

#: NVML's field id of the GPU's recovery action (``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``, driver >= r570).
RECOVERY_ACTION_FIELD = 230


class Verdict(StrEnum):
    """What a signal asks of the job; ordered by urgency in :data:`URGENCY`."""

    MOVE_NOW = "move_now"
    PLAN_MOVE = "plan_move"
    APP_FAULT = "app_fault"
    NONE = "none"
    UNKNOWN = "unknown"


#: Most urgent first: the verdict of several findings is the first of these among them.
URGENCY = (Verdict.MOVE_NOW, Verdict.PLAN_MOVE, Verdict.APP_FAULT, Verdict.UNKNOWN, Verdict.NONE)


class Kind(StrEnum):
    """The kind of a signal: what a row's ``key`` is."""

    XID = "xid"  #: an XID code (NVML's critical-XID event carries it)
    RECOVERY_ACTION = "recovery_action"  #: NVML field 230's value
    NVML_EVENT = "nvml_event"  #: an NVML event type bit, other than the XID and recovery-action events
    ECC = "ecc"  #: the uncorrectable ECC count (NVML volatile, AMD SMI total)
    REMAP = "remap"  #: row remapping, page retirement (NVML), bad pages (AMD SMI)
    THROTTLE = "throttle"  #: a clock-event (throttle) reason, by its name in facts.THROTTLE_REASONS
    GPU = "gpu"  #: the GPU as a whole (lost)
    AMD_EVENT = "amd_event"  #: an AMD SMI event notification type


@dataclass(frozen=True)
class Rule:
    """One row of the table: ``kind`` ``key`` (``name``) -> ``verdict``, because ``reason``."""

    kind: Kind
    key: int | str
    name: str
    verdict: Verdict
    reason: str
    source: str


_XID = "NVIDIA XID catalog (leptonai/gpud catalog_generated.go, 2025-10)"
_PYNVML = "nvidia-ml-py 13.615.71 pynvml.py"
_AMDSMI = "amdsmi 7.0.2 amdsmi_interface.py"
_OURS = "ours"
_M, _P, _A, _N = Verdict.MOVE_NOW, Verdict.PLAN_MOVE, Verdict.APP_FAULT, Verdict.NONE


def _r(kind: Kind, key: int | str, name: str, verdict: Verdict, source: str, reason: str) -> Rule:
    return Rule(kind, key, name, verdict, reason, source)


def _t(name: str, verdict: Verdict, reason: str) -> Rule:
    """A throttle reason's row: keyed by its name in facts.THROTTLE_REASONS."""
    return Rule(Kind.THROTTLE, name, name, verdict, reason, _PYNVML)


X, RA, EV, AE = Kind.XID, Kind.RECOVERY_ACTION, Kind.NVML_EVENT, Kind.AMD_EVENT
_ECC_SRC = "NVML volatile count; AMD SMI total_ecc_count"
_REMAP_SRC = "nvmlDeviceGetRemappedRows"

# One row a signal: kind, key, name, verdict, source, then the reason. Kept as a table (fmt: off).
# fmt: off
RULES: tuple[Rule, ...] = (
    # -- XIDs (NVML's critical-XID event carries the code in eventData) --------------------------
    _r(X, 13, "GR_EXCEPTION", _A, _XID, "graphics engine exception: NVIDIA says restart the application"),
    _r(X, 31, "MMU_ERR_FLT", _A, _XID, "GPU memory page fault: the application's bad address, usually a bug"),
    _r(X, 43, "RESETCHANNEL_VERIF_ERROR", _A, _XID,
       "the GPU stopped the application's channel; NVIDIA: ignore"),
    _r(X, 45, "PREEMPTIVE_CLEANUP", _A, "the health config's default xid_ignore",
       "channel clean-up after a process ended (a killed rank too): the GPU is fine"),
    _r(X, 46, "GPU_TIMEOUT_ERROR", _M, _XID, "NVIDIA: reset the GPU; work on it is lost"),
    _r(X, 48, "GPU_ECC_DBE", _M, _XID, "double-bit ECC error: the GPU's memory holds wrong data"),
    _r(X, 62, "PMU_HALT_ERROR", _M, _XID, "an internal micro-controller halted: NVIDIA says reset the GPU"),
    _r(X, 63, "DRAM_RETIREMENT_EVENT", _P, _XID,
       "a row remap is recorded and takes effect at the next GPU reset: the GPU works until then"),
    _r(X, 64, "DRAM_RETIREMENT_FAILURE", _M, _XID,
       "row remapping failed: the GPU needs service (AWS isolates it)"),
    _r(X, 74, "NVLINK_ERROR", _P, _XID, "NVLink error: the GPU computes; its links are suspect"),
    _r(X, 79, "GPU_HAS_FALLEN_OFF_THE_BUS", _M, _XID,
       "the GPU is gone from the bus: NVIDIA says reboot the node"),
    _r(X, 92, "EXCESSIVE_SBE_INTERRUPTS", _P, _XID, "too many corrected errors: the memory is degrading"),
    _r(X, 94, "CONTAINED_MEMORY_ERROR", _A, _XID,
       "contained: only the process that touched the memory is hit and the GPU stays usable; "
       "the row remap it leaves pending is its own signal (remap pending)"),
    _r(X, 95, "UNCONTAINED_MEMORY_ERROR", _M, _XID, "uncontained memory error: NVIDIA says reset the GPU"),
    _r(X, 119, "GSP_RPC_TIMEOUT", _M, _XID, "the GPU's system processor does not answer: reset the GPU"),
    _r(X, 120, "GSP_ERROR", _M, _XID, "the GPU's system processor failed: reset the GPU"),
    _r(X, 140, "UNRECOVERABLE_ECC_ERROR_ESCAPE", _M, _XID, "an ECC error escaped containment: reset the GPU"),
    *(_r(X, code, "NVLINK5_ERROR", _P, _XID, "NVLink5 error (Blackwell): as XID 74")
      for code in range(144, 151)),
    _r(X, 154, "GPU_RECOVERY_ACTION_CHANGED", _P, _XID,
       "the driver changed the GPU's recovery action: at least a planned move; "
       "the action itself (field 230, read at once) may say move now"),
    # -- NVML's recovery action: field 230, driver >= r570 ---------------------------------------
    _r(RA, 0, "NONE", _N, _PYNVML, "the driver asks for nothing"),
    _r(RA, 1, "GPU_RESET", _M, _PYNVML,
       "the GPU must be reset before it is used again: work on it fails or is wrong"),
    _r(RA, 2, "NODE_REBOOT", _M, _PYNVML, "the node must reboot"),
    _r(RA, 3, "DRAIN_P2P", _P, _PYNVML, "peer-to-peer traffic must drain; the GPU still computes (ours)"),
    _r(RA, 4, "DRAIN_AND_RESET", _P, _PYNVML,
       "drain, then reset: the GPU works until the drain, a planned move"),
    _r(RA, 5, "RECOVER_IMEX_DOMAIN", _P, _PYNVML,
       "the NVLink (IMEX) domain needs recovery, not this GPU alone: move at a safe point (ours)"),
    _r(RA, 6, "BUS_RESET", _M, _PYNVML, "the GPU's bus must be reset"),
    _r(RA, 7, "SYSTEM_REBOOT", _M, _PYNVML, "the system must reboot"),
    # -- NVML events other than the XID one (nvmlEventType*) -------------------------------------
    _r(EV, 0x1, "SingleBitEccError", _N, _PYNVML, "corrected: the health checks judge the rate"),
    _r(EV, 0x2, "DoubleBitEccError", _M, _PYNVML, "as XID 48"),
    _r(EV, 0x200, "SingleBitEccErrorStorm", _P, _PYNVML, "as XID 92"),
    _r(EV, 0x400, "DramRetirementEvent", _P, _PYNVML, "as XID 63"),
    _r(EV, 0x800, "DramRetirementFailure", _M, _PYNVML, "as XID 64"),
    _r(EV, 0x1000, "NonFatalPoisonError", _A, _PYNVML, "contained poison, one process hit: as XID 94 (ours)"),
    _r(EV, 0x2000, "FatalPoisonError", _M, _PYNVML, "poison not contained: as XID 95 (ours)"),
    _r(EV, 0x4000, "GpuUnavailableError", _M, _PYNVML, "the GPU is unavailable"),
    _r(EV, 0x8000, "GpuRecoveryAction", _N, _PYNVML,
       "the action changed: its value (field 230, read at once) decides"),
    # -- ECC, remaps, the GPU as a whole (NVML, and AMD SMI where it has them) -------------------
    _r(Kind.ECC, "uncorrectable_new", "DBE", _M, _ECC_SRC,
       "uncorrectable errors while the job runs: as XID 48"),
    _r(Kind.ECC, "uncorrectable_standing", "DBE", _P, _ECC_SRC,
       "uncorrectable errors from before the agent's first reading: the GPU ran since, so it moves at a "
       "safe point and gets reset (ours)"),
    _r(Kind.REMAP, "failure", "remap failure", _M, _REMAP_SRC, "row remapping failed: as XID 64"),
    _r(Kind.REMAP, "pending", "remap pending", _P, _REMAP_SRC, "a remap waits for a GPU reset: as XID 63"),
    _r(Kind.REMAP, "retirement_pending", "retirement pending", _P,
       "NVML retired pages; AMD SMI bad_page_info",
       "a page retirement waits for a reset (NVIDIA before A100; AMD bad pages): as XID 63"),
    _r(Kind.GPU, "lost", "GPU_IS_LOST", _M, _PYNVML, "the library answers GPU_IS_LOST: the GPU is gone"),
    # -- throttle (clock event) reasons, by their names in facts.THROTTLE_REASONS ----------------
    _t("gpu_idle", _N, "no work"),
    _t("applications_clocks_setting", _N, "an admin's clock setting"),
    _t("sw_power_cap", _N, "the board holds its power limit: normal under full load"),
    _t("hw_slowdown", _P,
       "the hardware slows the clocks (cooling or power): the GPU works, slower, and slows every rank"),
    _t("sync_boost", _N, "clocks held in step with other GPUs"),
    _t("sw_thermal_slowdown", _N,
       "the driver keeps the GPU under its slowdown temperature; the temperature check warns"),
    _t("hw_thermal_slowdown", _P,
       "the hardware throttles for heat: cooling is failing"),
    _t("hw_power_brake_slowdown", _P,
       "an external power brake (power supply, chassis); gpud counts it as a hardware slowdown"),
    _t("display_clock_setting", _N, "a display clock setting"),
    # -- AMD SMI event notifications (AMDSMI_EVT_NOTIF_*) ----------------------------------------
    _r(AE, 1, "VMFAULT", _A, _AMDSMI, "a GPU page fault: the application's bad address, as XID 31"),
    _r(AE, 2, "THERMAL_THROTTLE", _P, _AMDSMI, "the GPU throttles for heat: as hw_thermal_slowdown"),
    _r(AE, 3, "GPU_PRE_RESET", _M, _AMDSMI, "the driver is resetting the GPU: work on it is lost"),
    _r(AE, 4, "GPU_POST_RESET", _N, _AMDSMI, "the reset is over; its pre-reset event moved the job"),
)

#: The verdict of a signal no row names, by kind, with the reason.
DEFAULTS: Mapping[Kind, Rule] = {
    X: _r(X, "*", "UNLISTED", _P, _OURS,
          "NVML delivers only the XIDs the driver calls critical; one this table does not know moves the "
          "job at a safe point, where nothing is lost, and the drain reason names it"),
    RA: _r(RA, "*", "UNLISTED", _P, _OURS, "a newer driver's action: any action but NONE asks for service"),
    EV: _r(EV, "*", "UNLISTED", _N, _OURS, "an event type not registered for"),
    Kind.THROTTLE: _r(Kind.THROTTLE, "*", "UNLISTED", _N, _OURS, "a slowdown alone is not a fault"),
    AE: _r(AE, "*", "UNLISTED", _N, _OURS, "an event type not registered for"),
}
# fmt: on

_BY_KEY: Mapping[tuple[Kind, int | str], Rule] = {(r.kind, r.key): r for r in RULES}

#: The NVML event types the waiter registers for (``nvmlEventType*``): every one with a verdict.
NVML_EVENTS: Mapping[int, str] = {
    0x8: "XidCriticalError",
    **{int(r.key): r.name for r in RULES if r.kind == Kind.NVML_EVENT and r.verdict != _N},
    0x8000: "GpuRecoveryAction",
}
#: The AMD SMI event types (``AMDSMI_EVT_NOTIF_*``) with a verdict.
AMD_EVENTS: Mapping[int, str] = {int(r.key): r.name for r in RULES if r.kind == Kind.AMD_EVENT}


def rule(kind: Kind, key: int | str) -> Rule:
    """The row of ``kind`` ``key``, else the kind's default (ECC, remap, GPU keys are all rows)."""
    found = _BY_KEY.get((kind, key))
    if found is not None:
        return found
    return DEFAULTS[kind]


@dataclass(frozen=True)
class Finding:
    """One signal on one GPU (``gpu`` None: the node, or a GPU the library could not name)."""

    gpu: int | None
    signal: str
    verdict: Verdict
    reason: str

    @property
    def short(self) -> str:
        """``GPU 1 xid 79 GPU_HAS_FALLEN_OFF_THE_BUS: move now`` (what a drain reason can hold)."""
        where = "GPU ?" if self.gpu is None else f"GPU {self.gpu}"
        return f"{where} {self.signal}: {self.verdict.value.replace('_', ' ')}"

    def __str__(self) -> str:
        return f"{self.short} ({self.reason})"


def _finding(gpu: int | None, kind: Kind, key: int | str, what: str | None = None) -> Finding:
    row = rule(kind, key)
    name = row.name if row.key != "*" else "(unlisted)"
    return Finding(gpu, what or f"{kind.value} {key} {name}", row.verdict, row.reason)


def judge_xid(gpu: int | None, code: int) -> Finding:
    """An XID code (the ``eventData`` of NVML's critical-XID event)."""
    return _finding(gpu, Kind.XID, code)


def judge_recovery_action(gpu: int | None, action: int) -> Finding:
    """NVML field 230's value."""
    return _finding(gpu, Kind.RECOVERY_ACTION, action)


def judge_event(gpu: int | None, event_type: int, event_data: int) -> list[Finding]:
    """One NVML event (``c_nvmlEventData_t``): the XID event by its code, others by type."""
    if event_type == 0x8:
        return [judge_xid(gpu, event_data)]
    return [
        _finding(gpu, Kind.NVML_EVENT, event_type, f"event {NVML_EVENTS.get(event_type, hex(event_type))}")
    ]


def judge_amd_event(gpu: int | None, event_type: int) -> Finding:
    """One AMD SMI event notification (``AMDSMI_EVT_NOTIF_*``)."""
    return _finding(gpu, Kind.AMD_EVENT, event_type)


@dataclass(frozen=True)
class GpuReading:
    """What the waiter reads of one GPU on each event and periodically (None: not reported)."""

    index: int
    uuid: str = ""
    lost: bool = False
    recovery_action: int | None = None
    #: uncorrectable ECC errors (NVML: the volatile count, since the driver loaded)
    ecc_uncorrected: int | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    retirement_pending: bool | None = None
    #: active throttle reasons by name (facts.THROTTLE_REASONS)
    throttle_reasons: tuple[str, ...] | None = None
    #: field -> error text, for each read that failed
    errors: tuple[tuple[str, str], ...] = ()


def reading_from_facts(gpu: GpuFacts) -> GpuReading:
    """The reading of a GPU some other source gathered (AMD SMI, simulated): no recovery action."""
    return GpuReading(
        index=gpu.index,
        uuid=gpu.uuid,
        lost=gpu.lost,
        ecc_uncorrected=gpu.ecc_uncorrected,
        remapped_rows_pending=gpu.remapped_rows_pending,
        remapped_rows_failure=gpu.remapped_rows_failure,
        retirement_pending=gpu.retired_pages_pending,
        throttle_reasons=gpu.throttle_reasons,
        errors=gpu.errors,
    )


def judge_reading(now: GpuReading, before: GpuReading | None) -> list[Finding]:
    """Every finding of ``now``; ``before`` is the same GPU's previous reading (None: the first).

    A throttle reason counts only when ``before`` had it too (a slowdown of one instant is not a
    failing GPU); ECC errors that rose since ``before`` are new, those of a first reading standing.
    """
    i = now.index
    out = [Finding(i, f"read {field}", Verdict.UNKNOWN, text) for field, text in now.errors]
    if now.lost:
        return [*out, _finding(i, Kind.GPU, "lost", "GPU lost")]
    if now.recovery_action is not None:
        out.append(judge_recovery_action(i, now.recovery_action))
    out += _ecc(i, now.ecc_uncorrected, None if before is None else before.ecc_uncorrected, before is None)
    for flag, key in (
        (now.remapped_rows_failure, "failure"),
        (now.remapped_rows_pending, "pending"),
        (now.retirement_pending, "retirement_pending"),
    ):
        if flag:
            out.append(_finding(i, Kind.REMAP, key, f"remap {key}"))
    held = set(before.throttle_reasons or ()) if before is not None else set()
    for name in now.throttle_reasons or ():
        if name in held:
            out.append(_finding(i, Kind.THROTTLE, name, f"throttle {name}"))
    return out


def _ecc(i: int, now: int | None, before: int | None, first: bool) -> list[Finding]:
    if not now:
        return []
    if first:
        return [_finding(i, Kind.ECC, "uncorrectable_standing", f"{now} uncorrectable ECC error(s)")]
    if before is not None and now > before:
        return [_finding(i, Kind.ECC, "uncorrectable_new", f"{now - before} new uncorrectable ECC error(s)")]
    return []


def worst(findings: Iterable[Finding]) -> Verdict:
    """The most urgent verdict among ``findings`` (:data:`URGENCY`); NONE when there are none."""
    present = {f.verdict for f in findings}
    return next((v for v in URGENCY if v in present), Verdict.NONE)


def summary(findings: Sequence[Finding], verdict: Verdict) -> str:
    """The findings of ``verdict``, one line, for a report."""
    return "; ".join(f.short for f in findings if f.verdict == verdict)
