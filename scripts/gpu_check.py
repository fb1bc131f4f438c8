"""scripts/gpu-check: what one GPU machine can prove about torchpass on NCCL, in under 10 minutes.

    scripts/gpu-check [--json FILE] [--shard-mb 1024] [--only nccl,transfer,nvml] [--nccl-net]

Steps, each guarded (a step that cannot run says why and the others go on):

1. ``environment``: torch, CUDA, the GPUs, torch's NCCL version, pynvml.
2. ``nccl-abort`` and ``nccl-shrink``: two NCCL ranks (on one GPU: NCCL >= 2.30
   with ``NCCL_MULTI_RANK_GPU_ENABLE=1``, from ``pip install -U nvidia-nccl-cu12``;
   on two GPUs: any NCCL), built by the product's NCCL seam
   (``torchpass_slurm.rank.backends.NcclBackend``: non-blocking, eagerly
   connected, with the environment tp run sets, ``config.NCCL_RECOVERY_ENV``) and
   warmed up; rank 1 is SIGKILLed while rank 0 sits in an all-reduce it never
   joins. Rank 0 times the seam's ``abort_all`` (torch's group abort) in one
   trial and its ``rebuild`` to a shrunk world (``shrink_group`` with
   ``SHRINK_ABORT``, NCCL >= 2.27.3) in the other. After the abort a third
   process, the spare (CUDA up, waiting), and rank 0 build epoch 1's communicator
   through the seam (``rebuild``: FRESH, over the store prefix ``epoch1``): the time
   to its first all-reduce, whose value is checked. ``--nccl-net`` also sets
   ``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1`` (the network path).
3. ``transfer``: a GPU shard (400 tensors of mixed sizes and dtypes, ``--shard-mb``)
   moved with the product's ``send_state``/``recv_state`` over a loopback
   ``SocketTransport`` into pre-allocated GPU tensors (transfer/device_stage.py:
   one device-to-host copy per chunk, pinned buffers), GB/s against the plain
   device-to-host copy of the same bytes (one pinned copy) and against copying
   tensor by tensor; the result bitwise equal.
4. ``nvml``: the live NVML fields (pynvml): recovery action (field 230), remapped
   rows, ECC, clock-event reasons, temperature, power, one XID event wait; and
   what one full read costs. Nothing is changed on the device.

Without a GPU it says so and exits 0. Exit 1 only when a step that ran failed its check.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

OK, FAILED, SKIPPED = "ok", "failed", "skipped"
#: Longest a multi-process NCCL trial may take before it counts as failed (hung).
TRIAL_TIMEOUT_S = 120.0
#: NCCL versions: two ranks on one GPU, ncclCommShrink.
MULTI_RANK_NCCL = (2, 30, 0)
SHRINK_NCCL = (2, 27, 3)


@dataclass
class StepResult:
    name: str
    status: str  # ok, failed, skipped
    detail: str = ""
    numbers: dict[str, Any] = field(default_factory=dict)


def exit_code(results: list[StepResult]) -> int:
    """0 unless a step that ran failed its check."""
    return 1 if any(r.status == FAILED for r in results) else 0


def run_step(name: str, fn: Callable[[], StepResult]) -> StepResult:
    """Run one step; an exception is that step's failure, not the script's."""
    try:
        return fn()
    except Exception as exc:  # the step broke: report it, the next steps go on
        detail = f"{type(exc).__name__}: {exc}"
        return StepResult(name, FAILED, detail, {"traceback": traceback.format_exc(limit=5)})


def version_text(version: tuple[int, ...] | None) -> str:
    return ".".join(map(str, version)) if version else "unknown"


def multi_rank_problem(nccl: tuple[int, ...] | None, gpus: int) -> str | None:
    """Why two NCCL ranks cannot run here, or None."""
    if gpus >= 2:
        return None
    if nccl is None:
        return "torch reports no NCCL version"
    if tuple(nccl) < MULTI_RANK_NCCL:
        return (
            f"one GPU and NCCL {version_text(nccl)}: two ranks on one GPU need NCCL >= "
            f"{version_text(MULTI_RANK_NCCL)} (pip install -U 'nvidia-nccl-cu12>=2.30')"
        )
    return None


def render(results: list[StepResult]) -> str:
    lines = []
    for r in results:
        lines.append(f"[{r.status.upper():>7}] {r.name}: {r.detail}")
        for key, value in r.numbers.items():
            if key != "traceback":
                lines.append(f"            {key}: {value}")
    code = exit_code(results)
    lines.append(f"gpu-check: {'every step that ran passed' if code == 0 else 'a step failed'}")
    return "\n".join(lines)


# --- environment ------------------------------------------------------------------------------


def environment() -> tuple[StepResult, dict[str, Any]]:
    import torch

    facts: dict[str, Any] = {"torch": torch.__version__, "cuda": bool(torch.cuda.is_available())}
    if not facts["cuda"]:
        return StepResult("environment", SKIPPED, "no GPU on this machine", facts), facts
    facts["gpus"] = torch.cuda.device_count()
    facts["names"] = [torch.cuda.get_device_name(i) for i in range(facts["gpus"])]
    try:
        nccl = tuple(torch.cuda.nccl.version())
    except (AttributeError, RuntimeError):
        nccl = None
    facts["nccl"] = list(nccl) if nccl else None
    try:
        import pynvml  # noqa: F401

        facts["pynvml"] = True
    except ImportError:
        facts["pynvml"] = False
    return StepResult("environment", OK, f"{facts['gpus']} GPU(s), NCCL {version_text(nccl)}", facts), facts


# --- NCCL: abort or shrink a communicator with a dead rank, then a spare --------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def env_set(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the children started inside (spawn copies os.environ)."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _seam_log() -> Any:
    import logging

    logging.basicConfig(level=logging.INFO, format="gpu-check %(process)d: %(message)s")
    return logging.LoggerAdapter(logging.getLogger("gpu-check"), {})


def _info(rank: int, gpus: int, epoch: int, port: int) -> Any:
    from torchpass_slurm.rank.rankinfo import RankInfo

    # local_rank picks the GPU in the seam (cuda:<local rank % devices>): both ranks on GPU 0
    # when there is one, one each when there are two. The store's port is named so that the
    # seam never takes the store's connections for the group's (gloo's abort shuts those down).
    return RankInfo(rank, 2, rank % gpus, min(gpus, 2), None, None, epoch, "127.0.0.1", port)


def _device(backend: str, index: int) -> Any:
    """The rank's device: a GPU for NCCL; the CPU for gloo (how the unit tests run the trial)."""
    import torch

    if backend != "nccl":
        return torch.device("cpu")
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _backend(name: str) -> Any:
    from torchpass_slurm.rank.backends import GlooBackend, NcclBackend

    return NcclBackend() if name == "nccl" else GlooBackend()


def _store(port: int, master: bool) -> Any:
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, None, master, timedelta(seconds=60))


def nccl_rank(
    mode: str, rank: int, port: int, gpus: int, events: dict[str, Any], out: Any, kind: str = "nccl"
) -> None:
    """Rank 0 or 1 of the first communicator (the seam's NcclBackend); rank 1 waits to be killed."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from torchpass_slurm.rank.backends import Rebuild, RebuildRequest

    log, timeout = _seam_log(), timedelta(seconds=90)
    device = _device(kind, rank % gpus)
    store = _store(port, rank == 0)
    backend = _backend(kind)
    backend.create(_info(rank, gpus, 0, port), timeout, log, store=dist.PrefixStore("epoch0", store))
    t = torch.ones(1 << 20, device=device)
    for _ in range(3):
        dist.all_reduce(t)
    _sync(device)
    out.put(("warm", rank, float(t[0].item())))
    if rank == 1:
        time.sleep(3600)  # SIGKILLed by the parent
        return
    dist.all_reduce(t, async_op=True)  # rank 1 never joins: the kernel waits on the GPU
    out.put(("in-collective", 0, 0.0))
    events["killed"].wait(60)
    began = time.perf_counter()
    if mode == "abort":
        aborted = backend.abort_all(log)
        out.put(("abort_s", 0, time.perf_counter() - began))
        out.put(("aborted", 0, float(aborted)))
        began = time.perf_counter()
        _sync(device)
        out.put(("drain_s", 0, time.perf_counter() - began))
        events["promote"].set()
        began = time.perf_counter()
        request = RebuildRequest(epoch=1, old_world=2, new_world=2)  # the spare takes rank 1

        def fresh() -> None:
            backend.create(_info(0, gpus, 1, port), timeout, log, store=dist.PrefixStore("epoch1", store))

        how = backend.rebuild(request, fresh, log)
        checked_all_reduce(0, device)
        out.put(("spare_s", 0, time.perf_counter() - began))
        out.put(("fresh", 0, float(how is Rebuild.FRESH)))
    else:
        request = RebuildRequest(epoch=1, old_world=2, new_world=1, excluded=(1,))

        def no_fresh() -> None:
            raise RuntimeError("the seam chose a fresh group where a shrink was asked for")

        how = backend.rebuild(request, no_fresh, log)
        out.put(("shrink_s", 0, time.perf_counter() - began))
        out.put(("shrunk", 0, float(how is Rebuild.SHRINK)))
        x = torch.full((4,), 3.0, device=device)
        dist.all_reduce(x)  # the shrunk group is the default group now (torch's shrink_group)
        _sync(device)
        out.put(("shrunk_allreduce", 0, float(x[0].item())))
    _exit(out)


def _exit(out: Any) -> None:
    """Flush the queue's feeder thread (its last messages would be lost), then leave at once: an
    aborted group's destructor is not waited for."""
    out.close()
    out.join_thread()
    os._exit(0)


def checked_all_reduce(rank: int, device: Any) -> None:
    """The first all-reduce of the new communicator: ranks add 1 and 2; raise unless 3."""
    import torch
    import torch.distributed as dist

    x = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(x)
    _sync(device)
    if float(x[0].item()) != 3.0:
        raise RuntimeError(f"the new communicator's all-reduce gave {x[0].item()}, expected 3.0")


def nccl_spare(port: int, gpus: int, events: dict[str, Any], out: Any, kind: str = "nccl") -> None:
    """The hot spare: CUDA up, then rank 1 of epoch 1's communicator (the seam) when promoted."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    device = _device(kind, 1 % gpus)
    torch.ones(1, device=device).sum().item()
    store = _store(port, False)
    out.put(("spare-ready", 2, 0.0))
    events["promote"].wait(120)
    began = time.perf_counter()
    _backend(kind).create(
        _info(1, gpus, 1, port), timedelta(seconds=90), _seam_log(), store=dist.PrefixStore("epoch1", store)
    )
    checked_all_reduce(1, device)
    out.put(("spare_side_s", 2, time.perf_counter() - began))
    _exit(out)


def nccl_trial(mode: str, gpus: int, extra_env: dict[str, str], kind: str = "nccl") -> StepResult:
    """One trial (``mode`` abort or shrink) of the module doc's step 2. ``kind`` "gloo" runs the
    same processes and checks on the CPU through the seam's GlooBackend (the unit test's way)."""
    name = f"nccl-{mode}"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    events = {"killed": ctx.Event(), "promote": ctx.Event()}
    port = free_port()
    got: dict[str, float] = {}
    with env_set(extra_env):
        procs = [ctx.Process(target=nccl_rank, args=(mode, r, port, gpus, events, out, kind)) for r in (0, 1)]
        if mode == "abort":
            procs.append(ctx.Process(target=nccl_spare, args=(port, gpus, events, out, kind)))
        for p in procs:
            p.start()
    deadline = time.monotonic() + TRIAL_TIMEOUT_S
    want = {
        "abort": {"abort_s", "aborted", "drain_s", "spare_s", "spare_side_s", "fresh"},
        "shrink": {"shrink_s", "shrunk", "shrunk_allreduce"},
    }[mode]
    try:
        while not want <= set(got) and time.monotonic() < deadline:
            try:
                what, rank, value = out.get(timeout=1.0)
            except Exception:  # queue.Empty
                if procs[0].exitcode not in (None, 0):
                    break
                continue
            got[f"{what}/{rank}" if what in ("warm",) else what] = value
            if what == "in-collective":
                time.sleep(0.5)  # the all-reduce is surely running
                procs[1].kill()  # SIGKILL
                events["killed"].set()
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    numbers = {k: round(v, 4) for k, v in got.items()}
    if not want <= set(got):
        code = procs[0].exitcode
        why = f"rank 0 exited with status {code}" if code not in (None, 0) else "a process hung"
        return StepResult(
            name,
            FAILED,
            f"missing {sorted(want - set(got))}: {why} (limit {TRIAL_TIMEOUT_S:.0f} s; its traceback above)",
            numbers,
        )
    if mode == "abort" and (got["aborted"] < 1.0 or got["fresh"] != 1.0):
        return StepResult(name, FAILED, "the seam aborted no group, or did not build a fresh one", numbers)
    if mode == "shrink" and (got["shrunk"] != 1.0 or got["shrunk_allreduce"] != 3.0):
        return StepResult(
            name, FAILED, "the seam did not shrink, or the shrunk all-reduce was wrong", numbers
        )
    return StepResult(name, OK, "rank 1 SIGKILLed mid-all-reduce; rank 0 recovered", numbers)


# --- transfer: a GPU shard with the product's code ----------------------------------------------


def make_shard(total_mb: int, device: Any, fill: bool) -> dict[str, Any]:
    import torch

    layers, state = 100, {}
    for i in range(layers):
        dtype = torch.bfloat16 if i % 4 == 3 else torch.float32
        hidden = 1024 + 61 * (i % 9)
        rows = max(int(total_mb * 1e6 / layers / (2 if i % 4 == 3 else 4) / hidden), 1)
        make = torch.randn if fill else torch.zeros
        state[f"layers.{i}.weight"] = make(rows, hidden, device=device).to(dtype)
        state[f"layers.{i}.bias"] = make(rows, device=device).to(dtype)
        state[f"layers.{i}.norm.weight"] = make(hidden, device=device).to(dtype)
        state[f"layers.{i}.norm.bias"] = make(hidden, device=device).to(dtype)
    return state


def transfer_step(shard_mb: int, gpus: int, kind: str = "cuda") -> StepResult:
    """Step 3; ``kind`` "cpu" runs the same code on host memory (the unit test's way)."""
    import threading
    from datetime import timedelta

    import torch

    from torchpass_slurm.transfer import SocketListener, SocketTransport, recv_state, send_state

    timeout = timedelta(seconds=120)
    cuda = kind == "cuda"
    src = make_shard(shard_mb, torch.device(kind, 0) if cuda else torch.device("cpu"), fill=True)
    dst = make_shard(shard_mb, torch.device(kind, 1 % gpus) if cuda else torch.device("cpu"), fill=False)
    nbytes = sum(t.numel() * t.element_size() for t in src.values())
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    flat = torch.empty(nbytes, dtype=torch.uint8, device=next(iter(src.values())).device)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    d2h = []
    for _ in range(3):
        began = time.perf_counter()
        pinned.copy_(flat, non_blocking=cuda)
        sync()
        d2h.append(time.perf_counter() - began)
    began = time.perf_counter()
    for t in src.values():
        t.cpu()  # what code that moves a state tensor by tensor does
    per_tensor_s = time.perf_counter() - began
    del flat, pinned
    with SocketListener("127.0.0.1", 0) as listener:
        sent: list[Any] = []
        donor = threading.Thread(
            target=lambda: sent.append(
                send_state(SocketTransport.connect("127.0.0.1", listener.port, timeout), src, timeout=timeout)
            )
        )
        donor.start()
        receiver = listener.accept(timeout)
    began = time.perf_counter()
    got, stats = recv_state(receiver, timeout=timeout, into=dst)
    took = time.perf_counter() - began
    donor.join(timeout=60)
    equal = all(
        got[k] is dst[k] and torch.equal(got[k].view(torch.uint8).cpu(), v.view(torch.uint8).cpu())
        for k, v in src.items()
    )
    numbers = {
        "tensors": len(src),
        "bytes": nbytes,
        "chunks": stats.chunks,
        "stream_gb_s": round(nbytes / took / 1e9, 3),
        "plain_d2h_gb_s": round(nbytes / min(d2h) / 1e9, 3),
        "per_tensor_d2h_gb_s": round(nbytes / per_tensor_s / 1e9, 3),
        "bitwise_equal": equal,
        "transport": "SocketTransport over 127.0.0.1",
    }
    status = OK if equal else FAILED
    return StepResult(
        "transfer", status, "GPU shard -> GPU through the stream" + ("" if equal else ": NOT EQUAL"), numbers
    )


# --- NVML ----------------------------------------------------------------------------------------


def nvml_step() -> StepResult:
    try:
        import pynvml
    except ImportError:
        return StepResult("nvml", SKIPPED, "pynvml is not installed (pip install nvidia-ml-py)")
    pynvml.nvmlInit()
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            return StepResult("nvml", FAILED, "NVML sees no GPU while CUDA does")
        numbers: dict[str, Any] = {"driver": _nvml(lambda: pynvml.nvmlSystemGetDriverVersion())}
        began = time.perf_counter()
        for i in range(count):
            numbers[f"gpu{i}"] = nvml_fields(pynvml, pynvml.nvmlDeviceGetHandleByIndex(i))
        numbers["read_all_ms"] = round((time.perf_counter() - began) * 1000, 2)
        numbers["xid_wait"] = xid_wait(pynvml, pynvml.nvmlDeviceGetHandleByIndex(0))
    finally:
        pynvml.nvmlShutdown()
    return StepResult("nvml", OK, f"{count} GPU(s) read; nothing changed", numbers)


def _nvml(fn: Callable[[], Any]) -> Any:
    try:
        value = fn()
    except Exception as exc:  # pynvml.NVMLError: not supported on this GPU or driver
        return f"unavailable ({exc})"
    return value.decode() if isinstance(value, bytes) else value


def nvml_fields(pynvml: Any, h: Any) -> dict[str, Any]:
    def field_value(field_id: int) -> Any:
        [value] = pynvml.nvmlDeviceGetFieldValues(h, [field_id])
        if value.nvmlReturn != 0:
            raise RuntimeError(f"NVML return {value.nvmlReturn}")
        return int(value.value.ullVal)

    return {
        "name": _nvml(lambda: pynvml.nvmlDeviceGetName(h)),
        "uuid": _nvml(lambda: pynvml.nvmlDeviceGetUUID(h)),
        "recovery_action_230": _nvml(lambda: field_value(230)),
        "remapped_rows": _nvml(lambda: list(pynvml.nvmlDeviceGetRemappedRows(h))),
        "ecc_volatile_uncorrected": _nvml(lambda: pynvml.nvmlDeviceGetTotalEccErrors(h, 1, 0)),
        "ecc_volatile_corrected": _nvml(lambda: pynvml.nvmlDeviceGetTotalEccErrors(h, 0, 0)),
        "clock_event_reasons": _nvml(lambda: hex(pynvml.nvmlDeviceGetCurrentClocksEventReasons(h))),
        "temperature_c": _nvml(lambda: pynvml.nvmlDeviceGetTemperature(h, 0)),
        "power_w": _nvml(lambda: pynvml.nvmlDeviceGetPowerUsage(h) / 1000),
    }


def xid_wait(pynvml: Any, h: Any) -> str:
    """Register for critical XIDs and wait 100 ms: a timeout is the healthy answer."""
    events = pynvml.nvmlEventSetCreate()
    try:
        pynvml.nvmlDeviceRegisterEvents(h, 0x8, events)  # XidCriticalError
        try:
            data = pynvml.nvmlEventSetWait_v2(events, 100)
        except pynvml.NVMLError as exc:
            return f"no event in 100 ms ({exc})"
        return f"event type {data.eventType:#x}, XID {data.eventData}"
    except Exception as exc:
        return f"unavailable ({exc})"
    finally:
        pynvml.nvmlEventSetFree(events)


# --- driver --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/gpu-check", description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="also write the report as JSON to this file")
    p.add_argument("--shard-mb", type=int, default=1024, help="size of the GPU shard moved (default 1024)")
    p.add_argument("--only", default="nccl,transfer,nvml", help="steps to run (default: all)")
    p.add_argument("--nccl-net", action="store_true", help="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1")
    args = p.parse_args(argv)
    only = set(args.only.split(","))
    env_result, facts = environment()
    results = [env_result]
    if not facts["cuda"]:
        print("gpu-check: no GPU on this machine (torch.cuda.is_available() is False): nothing to check")
        write_json(args.json, facts, results)
        return 0
    gpus = facts["gpus"]
    nccl = tuple(facts["nccl"]) if facts["nccl"] else None
    if "nccl" in only:
        problem = multi_rank_problem(nccl, gpus)
        from torchpass_slurm.config import NCCL_RECOVERY_ENV

        # What tp run sets for every rank (config.NCCL_RECOVERY_ENV), and two ranks per GPU.
        env = {name: value for name, (value, _) in NCCL_RECOVERY_ENV.items()}
        env["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
        if args.nccl_net:
            env |= {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
        for mode in ("abort", "shrink"):
            if problem is not None:
                results.append(StepResult(f"nccl-{mode}", SKIPPED, problem))
            elif mode == "shrink" and (nccl is None or nccl < SHRINK_NCCL):
                results.append(StepResult("nccl-shrink", SKIPPED, f"NCCL {version_text(nccl)} < 2.27.3"))
            else:
                results.append(run_step(f"nccl-{mode}", functools.partial(nccl_trial, mode, gpus, env)))
            print(render(results[-1:]).splitlines()[0], flush=True)
    if "transfer" in only:
        results.append(run_step("transfer", lambda: transfer_step(args.shard_mb, gpus)))
    if "nvml" in only:
        results.append(run_step("nvml", nvml_step))
    print(render(results))
    write_json(args.json, facts, results)
    return exit_code(results)


def write_json(path: Path | None, facts: dict[str, Any], results: list[StepResult]) -> None:
    if path is not None:
        doc = {"gpu": facts["cuda"], "environment": facts, "steps": [asdict(r) for r in results]}
        path.write_text(json.dumps(doc, indent=2, default=str) + "\n")


if __name__ == "__main__":
    sys.exit(main())
