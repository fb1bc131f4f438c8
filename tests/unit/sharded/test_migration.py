"""Live migration of sharded training between real gloo ranks (spawned, 127.0.0.1): a lost
HSDP rank's shards come from its replica; a drained pure-FSDP rank sends its own. Each run
ends bitwise equal to a fault-free run of the same steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from ..elastic.test_sync_state import assert_same
from . import ranks

K, STEPS = 3, 6


@pytest.fixture(autouse=True)
def _no_libuv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("USE_LIBUV", "0")


def fault_free(out: Path, mesh: str, world: int) -> None:
    with ranks.host_store(out) as port:
        ranks.run([("ref", r) for r in range(world)], mesh, port, out, K, STEPS)


def test_a_lost_hsdp_rank_gets_only_its_shards_from_its_replica_and_ends_bitwise_equal(
    tmp_path: Path,
) -> None:
    fault_free(tmp_path, "2x2", 4)
    jobs = [("survivor", 0), ("lost", 1), ("survivor", 2), ("survivor", 3), ("spare", 1)]
    with ranks.host_store(tmp_path) as port:
        ranks.run(jobs, "2x2", port, tmp_path, K, STEPS)

    for rank in range(4):
        ref = ranks.load(tmp_path, "ref", rank)
        got = ranks.load(tmp_path, "spare" if rank == 1 else "survivor", rank)
        assert got["step"] == ref["step"] == STEPS
        assert_same(got["state"], ref["state"], f"rank{rank}")
    spare = ranks.load(tmp_path, "spare", 1)
    assert spare["received"]
    (done,) = [f for e, f in spare["reports"] if e == "transfer_done"]
    assert (done["donor"], done["receiver"], done["step"], done["via"]) == (3, 1, K, "group")
    assert done["sealed"] is True
    own = ranks.state_bytes(spare["state"])
    model = sum(ranks.state_bytes(ranks.load(tmp_path, "ref", r)["state"]) for r in (0, 1))  # one replica
    assert done["bytes"] == own  # rank 1's parameters and optimizer state, nothing else
    assert done["bytes"] < 0.6 * model
    print(f"moved {done['bytes']} bytes of rank 1's shards; one replica of the model holds {model}")
    (live_ready,) = [f for e, f in spare["reports"] if e == "live_ready"]
    assert live_ready["mesh"] == {"dims": ["replicate", "shard"], "shape": [2, 2], "replicate": "replicate"}
    r0 = ranks.load(tmp_path, "survivor", 0)
    (agreement,) = [f for e, f in r0["reports"] if e == "agreement"]
    assert (agreement["committed_step"], agreement["receivers"], agreement["donors"]) == (K, [1], [3])


def test_a_drained_fsdp_rank_sends_its_own_shards_to_the_spare_and_the_run_ends_bitwise_equal(
    tmp_path: Path,
) -> None:
    fault_free(tmp_path, "1x4", 4)
    jobs = [("drain", r) for r in range(4)] + [("spare", 1)]
    with ranks.host_store(tmp_path) as port:
        ranks.run(jobs, "1x4", port, tmp_path, K, STEPS)

    for rank in range(4):
        ref = ranks.load(tmp_path, "ref", rank)
        got = ranks.load(tmp_path, "spare" if rank == 1 else "drain", rank)
        assert got["step"] == STEPS
        assert_same(got["state"], ref["state"], f"rank{rank}")
    assert not (tmp_path / "drain1.pt").exists()  # the leaving rank left at the switch
    spare = ranks.load(tmp_path, "spare", 1)
    (done,) = [f for e, f in spare["reports"] if e == "transfer_done"]
    assert (done["donor"], done["receiver"], done["step"], done["via"]) == (1, 1, K, "socket")
    assert done["sealed"] is True
    assert done["bytes"] == ranks.state_bytes(spare["state"])
