"""MeshLayout: coordinates as init_device_mesh lays ranks out, replicas, donors."""

from __future__ import annotations

import pytest

from torchpass_slurm.mesh import MeshLayout, assign_donors

HSDP = MeshLayout(("replicate", "shard"), (2, 2))
FSDP = MeshLayout(("shard",), (4,), replicate=None)


def test_coordinates_are_row_major_like_init_device_mesh() -> None:
    torch = pytest.importorskip("torch")
    expected = torch.arange(8).view(2, 2, 2)
    layout = MeshLayout(("pp", "replicate", "shard"), (2, 2, 2))
    for rank in range(8):
        assert int(expected[layout.coord(rank)]) == rank
        assert layout.rank_at(layout.coord(rank)) == rank


def test_an_hsdp_rank_is_replicated_across_the_replicate_dimension() -> None:
    assert [HSDP.replicas(r) for r in range(4)] == [[2], [3], [0], [1]]
    assert HSDP.shard_coord(0) == HSDP.shard_coord(2) == (0,)
    assert HSDP.replica_index(3) == 1


def test_ddp_ranks_are_replicas_of_every_other_and_pure_fsdp_of_none() -> None:
    ddp = MeshLayout.ddp(3)
    assert ddp.replicas(1) == [0, 2]
    assert FSDP.replicas(1) == []
    assert FSDP.without_replica([1]) == [1]
    assert HSDP.without_replica([0]) == []
    assert HSDP.without_replica([0, 2, 3]) == [0, 2]


def test_donors_spread_over_replica_groups_and_avoid_the_batch_host() -> None:
    layout = MeshLayout(("replicate", "shard"), (3, 2))  # ranks 0-1 | 2-3 | 4-5
    # ranks 0 and 1 lost: their replicas live in groups 1 and 2; one donor from each
    assert assign_donors(layout, [0, 1], holders=[2, 3, 4, 5]) == {0: 2, 1: 5}
    assert assign_donors(MeshLayout.ddp(3), [2], holders=[0, 1], avoid=[0]) == {2: 1}
    assert assign_donors(MeshLayout.ddp(3), [2], holders=[0], avoid=[0]) == {2: 0}
    assert assign_donors(FSDP, [1], holders=[0, 2, 3]) == {}


@pytest.mark.parametrize(
    "bad",
    [
        {"dims": ["replicate"], "shape": [0]},
        {"dims": ["a", "a"], "shape": [1, 1]},
        {"dims": ["shard"], "shape": [2], "replicate": "replicate"},
        {"dims": ["x y"], "shape": [2]},
        {"dims": [{"a": 1}, {"a": 1}], "shape": [1, 1]},
        {"dims": [["shard"]], "shape": [2]},
        {"dims": ["shard"], "shape": [True]},
        {"dims": "shard", "shape": [2]},
        {"dims": ["shard"], "shape": [2], "extra": 1},
        [1, 2],
    ],
)
def test_a_malformed_layout_from_a_report_is_refused(bad: object) -> None:
    with pytest.raises(ValueError):
        MeshLayout.from_json(bad)


def test_a_layout_survives_its_json() -> None:
    assert MeshLayout.from_json(HSDP.to_json()) == HSDP
    assert MeshLayout.from_json(FSDP.to_json()) == FSDP
