#!/usr/bin/env python3
"""tiny_gpt trained by torchft: the open peer of torchpass-slurm, on the same model and data.

One implementation of the model, two training drivers: the model, its optimizer, the data
(``batch(seed, step, rank, world)``), the per-rank dropout seed and the state hashes are
``tiny_gpt.py``'s, imported from it; this file is only the torchft way of driving them, as
torchft's own ``train_ddp.py`` does:

- one replica group per node (here one process per group), ``REPLICA_GROUP_ID`` and
  ``NUM_REPLICA_GROUPS`` in the environment, the Lighthouse's address in ``TORCHFT_LIGHTHOUSE``;
- a ``torchft.Manager`` per group over a reconfigurable ``ProcessGroupGloo`` (5 s timeout),
  recovering groups healed from a healthy one over that group (``PGTransport``, 10 s), the
  manager's timeout 30 s and ``min_replica_size=1`` (train_ddp.py's settings);
- ``torchft.DistributedDataParallel`` and ``torchft.Optimizer`` (the wrapper: ``zero_grad``
  starts the quorum, ``step`` applies the update only if every participant agrees at
  ``should_commit``).

Replica group ``g`` trains at step ``s`` on ``tiny_gpt.batch(seed, s, g, NUM_REPLICA_GROUPS)``:
the rank ``g`` shard of a ``NUM_REPLICA_GROUPS``-way data-parallel job, exactly what rank ``g``
of ``tiny_gpt.py`` reads. So a fault-free run trains on the same samples as tiny_gpt.py under
``tp run`` or plain DDP; a step committed by fewer groups than that skips the missing groups'
samples (torchft averages over the participants), and a healing group sits its first step out.

Each commit is a JSON line in ``$TORCHFT_LOG_DIR/torchft-g<group>.jsonl`` (appended across a
group's restarts): ``{"t", "group", "step", "quorum", "participants", "restart"}``; the end is a
line ``{"done": ...}`` with the final loss and the hashes, and rank 0's stdout gets tiny_gpt's
``throughput`` and ``done`` lines. Launched by ``tiny_gpt_torchft.sbatch``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

# tiny_gpt.py and tiny_gpt_hsdp.py, whose model and data this drives, are the examples'; the
# other driver is beside this file.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sbatch-examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_gpt
import torch

#: How long a fresh start waits for every replica group's first heartbeat (seconds), so the
#: first quorum holds all groups and a fault-free run trains on every shard from step 0.
START_BARRIER_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class CommitLog:
    """One JSON line per committed step, appended (a restarted group adds to its file)."""

    def __init__(self, folder: Path, group: int, restart: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"torchft-g{group}.jsonl"
        self.group, self.restart = group, restart

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(
                json.dumps(
                    {"t": round(time.time(), 3), "group": self.group, "restart": self.restart, **record}
                )
                + "\n"
            )


def start_barrier(folder: Path, group: int, groups: int) -> None:
    """A fresh job's groups wait for each other before their first quorum (a restart does not)."""
    (folder / f"torchft-ready-{group}").touch()
    deadline = time.monotonic() + START_BARRIER_S
    while sum(1 for g in range(groups) if (folder / f"torchft-ready-{g}").exists()) < groups:
        if time.monotonic() > deadline:
            raise SystemExit(
                f"tiny_gpt_torchft: not every replica group started within {START_BARRIER_S:.0f} s"
            )
        time.sleep(0.1)
    time.sleep(1.0)  # the managers' heartbeats reach the Lighthouse before the first quorum


def ddp_class(hook: str) -> type:
    """torchft's DDP wrapper as shipped, or with its comm hook's error path fixed.

    torchft 0.2.0's ``DistributedDataParallel._comm_hook`` waits on the Manager's allreduce
    and returns the work's inner future with ``assert fut._fut``; when the allreduce failed
    (a peer died), ``wait()`` records the error for ``should_commit`` and returns False, the
    inner future is never set, and the assertion kills the surviving replica: every group
    that shared the step dies with the lost one (measured on the bookworm cluster). With
    ``TORCHFT_DDP_HOOK=fixed`` the hook returns the bucket as it is once the Manager has
    recorded an error: ``should_commit`` then discards the step, as torchft intends.
    """
    from torchft import DistributedDataParallel

    if hook != "fixed":
        return DistributedDataParallel

    class FixedHookDDP(DistributedDataParallel):
        @staticmethod
        def _comm_hook(state, bucket):  # type: ignore[no-untyped-def]
            # No annotations: DDP's register_comm_hook compares them with dist.GradBucket and
            # Future[Tensor], and under `from __future__ import annotations` they are strings.
            work = state.allreduce(bucket.buffer())
            if work.wait() is False or state.errored() is not None:
                fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
                fut.set_result(bucket.buffer())  # garbage; the step is not committed
                return fut
            return work.get_future()._fut

    return FixedHookDDP


def main(argv: list[str] | None = None) -> int:
    from torchft import Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    args = tiny_gpt.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*find_unused_parameters=True.*")
    group = int(os.environ["REPLICA_GROUP_ID"])
    groups = int(os.environ["NUM_REPLICA_GROUPS"])
    restart = int(os.environ.get("TORCHFT_RESTART", "0"))
    folder = Path(os.environ.get("TORCHFT_LOG_DIR", "."))
    log = CommitLog(folder, group, restart)

    model, opt = tiny_gpt.build(args)  # identical initial weights in every group (same seed)
    # The group's own store (torchrun's job with one process per group); other groups reach
    # it by this node's name when the quorum picks it for the cross-group process group.
    host, port = socket.gethostname(), free_port()
    store = torch.distributed.TCPStore(host, port, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), opt.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
        replica_id=f"tiny_gpt_{group}",
        timeout=timedelta(seconds=30),
        checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=10), device=torch.device("cpu")),
        rank=0,
        world_size=1,
        store_addr=host,
        store_port=port,
        hostname=host,
    )
    ddp = ddp_class(os.environ.get("TORCHFT_DDP_HOOK", "shipped"))(manager, model)
    optimizer = Optimizer(manager, opt)
    if restart == 0:
        start_barrier(folder, group, groups)
    log.write({"event": "start", "node": host, "step": manager.current_step()})

    meter = tiny_gpt.Throughput(args, group, groups)
    loss = torch.tensor(float("nan"))
    while manager.current_step() < args.steps:
        optimizer.zero_grad()  # starts the quorum (asynchronously, overlapping the forward)
        step = manager.current_step()
        if args.step_sleep:
            time.sleep(args.step_sleep)  # part of the step's compute, as in tiny_gpt.py
        loss = tiny_gpt.loss_of(args, ddp, step, group, groups)  # backward: the allreduce
        optimizer.step()  # should_commit: applied only if every participant agrees
        done = manager.current_step()
        if done > step:
            meter.commit(done)
            log.write(
                {"step": done, "quorum": manager._quorum_id, "participants": manager.num_participants()}
            )
            if group == 0 and (done % args.log_every == 0 or done == args.steps):
                print(f"step={done} loss={float(loss.detach()):.4f}", flush=True)
        else:
            log.write({"event": "not committed", "step": step, "quorum": manager._quorum_id})
    params, optim = tiny_gpt.params_sha256(model), tiny_gpt.optim_sha256(opt)
    log.write(
        {
            "done": args.steps,
            "loss": round(float(loss.detach()), 4),
            "params_sha256": params,
            "optim_sha256": optim,
            "throughput": meter.line(),
        }
    )
    (folder / f"torchft-done-{group}").touch()  # the launcher's sign that the group finished
    if group == 0:
        print(meter.line(), flush=True)
        print(
            f"done step={args.steps} loss={float(loss.detach()):.4f} params_sha256={params} "
            f"optim_sha256={optim}",
            flush=True,
        )
    manager.shutdown(wait=False)
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
