"""A promoted spare ends with the lost rank's exact loader position, between two real gloo ranks on 127.0.0.1.

Rank 0 survives: it committed steps 0..2 and drew the batch of step 3 before the collective
failed (its copy tagged 4 was taken; step 3 is discarded). The lost rank 1 had sent copies
tagged 3 and 4; they reach the spare through a promote body, encoded and decoded as on the
wire. After the agreement on step 3 both ranks hold their loader of step 3: the survivor goes
back to its own copy, the spare loads the lost rank's, and both draw on exactly where an
uninterrupted run would.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
from pathlib import Path

import pytest
from torch import nn

from ..gloo_ranks import free_port
from .test_sync_state import JOIN_TIMEOUT_S

STEPS_DONE = 3


def _rank_main(rank: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from tests.unit.elastic.loader import ShardLoader
    from torchpass_slurm.control.bodies import Promote, PromoteMode
    from torchpass_slurm.rank.elastic import ElasticTrainer
    from torchpass_slurm.rank.rankstate import RankState
    from torchpass_slurm.rank.runtime import Runtime

    env = {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    os.environ.update(env)
    rt = Runtime.from_env(dict(env))
    rt.report = lambda event, **fields: None  # type: ignore[method-assign]
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = ShardLoader(rank, 2, size=16, batch=3)
    trainer = ElasticTrainer(
        rt,
        model,
        optimizer,
        state={"model": model},
        rank_state={"data": loader},
        start_step=STEPS_DONE if rank == 0 else -1,
    )
    assert trainer.rank_state is not None
    if rank == 0:
        for step in range(STEPS_DONE + 1):  # the batch of step 3 is drawn too; that step fails
            loader.next_batch()
            trainer.rank_state.capture(step + 1)
    else:  # the lost rank's copies, sent to the supervisor before it died, come with the promotion
        lost_loader = ShardLoader(1, 2, size=16, batch=3)
        lost = RankState(rt, {"data": lost_loader})
        for step in range(STEPS_DONE + 1):
            lost_loader.next_batch()
            lost.capture(step + 1)
        body = Promote(
            rank=1,
            local_rank=0,
            world_size=2,
            master_addr="127.0.0.1",
            master_port=port,
            epoch=1,
            mode=PromoteMode.LIVE,
            rank_state=tuple(lost._copies),
        ).to_body()
        rt.promotion = Promote.from_body(json.loads(json.dumps(body)))
        rt.is_spare_promoted = True
    rt.init_process_group("gloo", datetime.timedelta(seconds=30))
    trainer._sync_state()
    trainer._restore_rank_state(trainer.step)
    result = {"step": trainer.step, "state": loader.state_dict(), "next": loader.next_batch()}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def uninterrupted(rank: int) -> dict[str, object]:
    from .loader import ShardLoader

    loader = ShardLoader(rank, 2, size=16, batch=3)
    for _ in range(STEPS_DONE):
        loader.next_batch()
    return {"step": STEPS_DONE, "state": loader.state_dict(), "next": loader.next_batch()}


def test_the_spare_resumes_the_lost_ranks_loader_where_it_was_at_the_agreed_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("USE_LIBUV", "0")
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[3]))
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
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0 == uninterrupted(0)  # the survivor went back from its copy of step 4 to step 3's
    assert r1 == uninterrupted(1)  # the spare: the lost rank's exact position, and its next batch
