"""Membership: slots, rank remap on promotion, the spare pool, JSON."""

from __future__ import annotations

import json

import pytest

from torchpass_slurm.config import NodeRole
from torchpass_slurm.errors import ConfigError, MembershipError, NoSpareError
from torchpass_slurm.supervisor.membership import (
    Membership,
)

NODES = ["n1", "n2", "n3", "s1", "s2"]


@pytest.fixture
def m0() -> Membership:
    return Membership.initial(NODES, n_active=3, ntasks_per_node=4)


def test_initial(m0: Membership) -> None:
    assert (m0.epoch, m0.active, m0.spares, m0.failed) == (0, ("n1", "n2", "n3"), ("s1", "s2"), ())
    assert m0.world_size == 12


def test_ranks_and_roles(m0: Membership) -> None:
    assert m0.ranks_of("n2") == range(4, 8)
    assert m0.rank_base("n3") == 8
    assert [m0.node_of_rank(r) for r in (0, 3, 4, 11)] == ["n1", "n1", "n2", "n3"]
    assert (m0.role_of("n1"), m0.role_of("s2")) == (NodeRole.ACTIVE, NodeRole.SPARE)


@pytest.mark.parametrize("rank", [-1, 12])
def test_rank_out_of_range(m0: Membership, rank: int) -> None:
    with pytest.raises(MembershipError, match=r"outside 0\.\.11"):
        m0.node_of_rank(rank)


def test_queries_on_nodes_without_ranks(m0: Membership) -> None:
    with pytest.raises(MembershipError, match="role is 'spare'"):
        m0.ranks_of("s1")
    with pytest.raises(MembershipError, match="not part of this job"):
        m0.role_of("zz")


def test_replace_promotes_first_spare_into_the_failed_slot(m0: Membership) -> None:
    m1 = m0.replace("n2")
    assert (m1.epoch, m1.active, m1.spares, m1.failed) == (1, ("n1", "s1", "n3"), ("s2",), ("n2",))
    assert m1.ranks_of("s1") == m0.ranks_of("n2")
    assert m1.world_size == m0.world_size
    assert m1.role_of("n2") == NodeRole.FAILED
    assert m0.active == ("n1", "n2", "n3")  # the old membership is unchanged


def test_every_rank_keeps_its_node_except_the_failed_ones(m0: Membership) -> None:
    m1 = m0.replace("n1")
    moved = {r for r in range(m0.world_size) if m0.node_of_rank(r) != m1.node_of_rank(r)}
    assert moved == set(m0.ranks_of("n1"))


def test_no_spare_left(m0: Membership) -> None:
    m2 = m0.replace("n1").replace("n3")
    assert m2.epoch == 2 and m2.spares == ()
    with pytest.raises(NoSpareError, match="ranks 0-3") as info:
        m2.replace("s1")
    assert "checkpoint-restart" in str(info.value)


def test_replace_needs_an_active_node(m0: Membership) -> None:
    with pytest.raises(MembershipError, match="role is 'spare'"):
        m0.replace("s1")
    with pytest.raises(MembershipError, match="role is 'failed'"):
        m0.replace("n1").replace("n1")


def test_drop_spare(m0: Membership) -> None:
    m1 = m0.drop_spare("s1")
    assert (m1.epoch, m1.active, m1.spares, m1.failed) == (1, m0.active, ("s2",), ("s1",))
    assert m1.replace("n1").active[0] == "s2"
    with pytest.raises(MembershipError, match="not a spare"):
        m1.drop_spare("n1")


def test_with_spare_refills_the_pool_in_the_same_epoch(m0: Membership) -> None:
    m1 = m0.replace("n2")  # s1 takes n2's slot
    m2 = m1.with_spare("x9")
    assert (m2.epoch, m2.active, m2.spares, m2.failed) == (m1.epoch, m1.active, ("s2", "x9"), ("n2",))
    repaired = m2.with_spare("n2")  # a lost node Slurm gave back leaves "failed"
    assert (repaired.spares, repaired.failed) == (("s2", "x9", "n2"), ())
    for taken in ("n1", "s2"):
        with pytest.raises(MembershipError, match="cannot join as a spare"):
            m2.with_spare(taken)


def test_initial_needs_enough_nodes() -> None:
    with pytest.raises(ConfigError, match="2 node"):
        Membership.initial(["a", "b"], n_active=3, ntasks_per_node=1)
    with pytest.raises(ConfigError, match="at least 1"):
        Membership.initial(["a"], n_active=1, ntasks_per_node=0)
    with pytest.raises(ConfigError, match="more than once: a"):
        Membership.initial(["a", "a"], n_active=1, ntasks_per_node=1)


def test_invariants_are_checked() -> None:
    with pytest.raises(MembershipError, match="more than once"):
        Membership(0, 1, ("a",), ("b",), ("a",))
    with pytest.raises(MembershipError, match="at least one active"):
        Membership(0, 1, ())
    with pytest.raises(MembershipError, match="epoch"):
        Membership(-1, 1, ("a",))


def test_json_round_trip(m0: Membership) -> None:
    m2 = m0.replace("n2").drop_spare("s2")
    assert Membership.from_json(m2.to_json()) == m2


@pytest.mark.parametrize(
    "text, match",
    [
        ("nope", "not JSON"),
        ("[]", "fields list"),
        (json.dumps({"format": 1}), "fields"),
        (
            json.dumps(
                {"format": 2, "epoch": 0, "ntasks_per_node": 1, "active": ["a"], "spares": [], "failed": []}
            ),
            "format 2",
        ),
        (
            json.dumps(
                {"format": 1, "epoch": 0, "ntasks_per_node": 1, "active": "a", "spares": [], "failed": []}
            ),
            "'active' is not a list",
        ),
        (
            json.dumps(
                {"format": 1, "epoch": "0", "ntasks_per_node": 1, "active": ["a"], "spares": [], "failed": []}
            ),
            "epoch",
        ),
    ],
)
def test_from_json_says_what_is_wrong(text: str, match: str) -> None:
    with pytest.raises(MembershipError, match=match):
        Membership.from_json(text)
