"""The agreement and transfer of ``ElasticTrainer._sync_state`` between two real gloo ranks on 127.0.0.1.

Rank 0 holds step 5 and a trained AdamW state; rank 1 is a promoted spare
(step -1, other weights, an empty optimizer). The control plane is left out:
the runtimes are plain and their reports are recorded.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ..gloo_ranks import free_port

#: Bounds the whole test: two spawned interpreters importing torch (and dynamo, with the first
#: optimizer: about 4 s each), one small transfer.
JOIN_TIMEOUT_S = 60


def _rank_main(rank: int, port: int, out: str) -> None:
    """One rank, in its own spawned process: build, sync, save what it holds."""
    import torch.distributed as dist

    from torchpass_slurm.rank.elastic import ElasticTrainer
    from torchpass_slurm.rank.runtime import Runtime

    env = {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    os.environ.update(env)
    rt = Runtime.from_env(dict(env))
    reports: list[tuple[str, dict[str, Any]]] = []
    rt.report = lambda event, **fields: reports.append((str(event), fields))  # type: ignore[method-assign]
    torch.manual_seed(rank)  # different weights on each rank
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if rank == 0:
        for _ in range(5):
            optimizer.zero_grad()
            model(torch.randn(4, 8)).pow(2).sum().backward()
            optimizer.step()
    trainer = ElasticTrainer(
        rt, model, optimizer, state={"model": model, "optim": optimizer}, start_step=5 if rank == 0 else -1
    )
    rt.init_process_group("gloo", datetime.timedelta(seconds=30))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer._sync_state()
    torch.save(
        {
            "step": trainer.step,
            "received": trainer.received_state,
            "before": before,
            "model": model.state_dict(),
            "optim": optimizer.state_dict(),
            "reports": reports,
        },
        Path(out) / f"rank{rank}.pt",
    )
    dist.destroy_process_group()


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Equal structure and bitwise-equal tensors (same dtype, shape and bytes)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, path


def test_a_rank_behind_receives_the_state_of_the_rank_at_the_agreed_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("USE_LIBUV", "0")  # the TCPStore of env://, inherited by the ranks
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    ranks = [ctx.Process(target=_rank_main, args=(r, port, str(tmp_path))) for r in range(2)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(JOIN_TIMEOUT_S)
    for p in ranks:
        if p.is_alive():
            p.kill()
            p.join()
    assert [p.exitcode for p in ranks] == [0, 0]

    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))
    assert not torch.equal(r0["before"]["0.weight"], r1["before"]["0.weight"])  # they did differ
    assert (r0["step"], r1["step"]) == (5, 5)
    assert (r0["received"], r1["received"]) == (False, True)
    assert_same(r0["model"], r1["model"])
    assert_same(r0["optim"], r1["optim"])
    assert r0["optim"]["state"], "rank 0's AdamW state is not empty"
    assert r0["reports"] == [
        ("agreement", {"committed_step": 5, "receivers": [1], "donors": [0], "epoch": 0})
    ]
    ((event, fields),) = r1["reports"]
    assert event == "transfer_done"
    assert {k: fields[k] for k in ("donor", "receiver", "step", "retries", "resumed_from", "epoch")} == {
        "donor": 0,
        "receiver": 1,
        "step": 5,
        "retries": 0,
        "resumed_from": 0,
        "epoch": 0,
    }
    assert fields["bytes"] > 0
