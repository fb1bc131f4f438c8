"""plan_recovery, the one place recovery is decided: a table over fault class, spares, the
elastic loop and the batch host."""

from __future__ import annotations

import dataclasses

import pytest

from torchpass_slurm.faults import Detector, Evidence, Fault, RecoveryPolicy
from torchpass_slurm.mesh import MeshLayout
from torchpass_slurm.supervisor.membership import Membership
from torchpass_slurm.supervisor.plan import Action, Policy, WorkerFacts, plan_recovery

BATCH = "b"  # the batch host: it runs the supervisor and rank 0
OTHER = "n2"
POLICY = Policy(recovery=RecoveryPolicy.LIVE, has_store=True, batch_host=BATCH)

#: One fault of each class, on a given node.
FAULTS = {
    "unplanned": lambda node: Fault(node, Detector.HEARTBEAT_LOST, f"no heartbeat from {node} for 21 s"),
    "pre-emptive": lambda node: Fault(node, Detector.HEALTH_WARNING, "WARNING: ECC errors rising"),
    "planned": lambda node: Fault(node, Detector.DRAIN, "firmware update"),
}


def membership(spare: bool) -> Membership:
    return Membership(0, 2, (BATCH, OTHER, "n3"), ("s1",) if spare else ())


def workers(elastic: bool, *, usable: bool = True) -> dict[str, WorkerFacts]:
    return {n: WorkerFacts(live=elastic, running=True, usable=usable) for n in (BATCH, OTHER, "n3", "s1")}


#: (fault class, a spare is free, every rank on the elastic loop, the fault is on the batch host) -> action
TABLE = [
    ("unplanned", True, True, False, Action.LIVE),
    ("unplanned", True, True, True, Action.LIVE),
    ("unplanned", True, False, False, Action.RESTART),
    ("unplanned", True, False, True, Action.RESTART),
    ("unplanned", False, True, False, Action.GIVE_UP),
    ("unplanned", False, True, True, Action.GIVE_UP),
    ("unplanned", False, False, False, Action.GIVE_UP),
    ("unplanned", False, False, True, Action.GIVE_UP),
    ("pre-emptive", True, True, False, Action.DRAIN),
    ("pre-emptive", True, True, True, Action.DRAIN),
    ("pre-emptive", True, False, False, Action.DRAIN),
    ("pre-emptive", True, False, True, Action.DRAIN),
    ("pre-emptive", False, True, False, Action.DRAIN),
    ("pre-emptive", False, True, True, Action.DRAIN),
    ("pre-emptive", False, False, False, Action.DRAIN),
    ("pre-emptive", False, False, True, Action.DRAIN),
    ("planned", True, True, False, Action.PLANNED),
    ("planned", True, True, True, Action.DEFER),
    ("planned", True, False, False, Action.DEFER),
    ("planned", True, False, True, Action.DEFER),
    ("planned", False, True, False, Action.DEFER),
    ("planned", False, True, True, Action.DEFER),
    ("planned", False, False, False, Action.DEFER),
    ("planned", False, False, True, Action.DEFER),
]


def test_the_table_covers_every_combination() -> None:
    combos = {row[:4] for row in TABLE}
    assert len(combos) == len(TABLE) == len(FAULTS) * 2 * 2 * 2


@pytest.mark.parametrize(("cls", "spare", "elastic", "batch", "action"), TABLE)
def test_plan(cls: str, spare: bool, elastic: bool, batch: bool, action: Action) -> None:
    node = BATCH if batch else OTHER
    m = membership(spare)
    fault = FAULTS[cls](node)

    plan = plan_recovery([fault], m, workers(elastic), POLICY)

    assert plan.action == action
    assert plan.faults == (fault,)
    if action in (Action.LIVE, Action.RESTART, Action.PLANNED):
        assert plan.lost == (fault,) and plan.promoted == ("s1",)
        assert plan.membership.epoch == 1
        assert plan.membership.active[m.slot_of(node)] == "s1"
        assert plan.membership.failed == (node,) and plan.membership.spares == ()
    else:
        assert plan.membership == m and plan.promoted == ()
    # a node that went silent leaves the job, unless it is the batch host (the supervisor runs there)
    expected_release = (node,) if cls == "unplanned" and not batch and action != Action.GIVE_UP else ()
    if action != Action.GIVE_UP:
        assert plan.release == expected_release
    assert plan.stop == ((node,) if cls == "unplanned" else ())
    if action == Action.DRAIN:
        assert plan.detail == "torchpass: pre-emptive: WARNING: ECC errors rising"
    if action == Action.DEFER:
        expected = "batch host" if batch else "no live migration possible"
        assert expected in plan.detail
    if action == Action.GIVE_UP:
        assert "no hot spare left" in plan.detail and plan.exit_code == 1


CRASH = Fault(OTHER, Detector.STEP_EXITED, "srun step on n2 exited with status 137", 137)


def test_a_crashed_rank_with_no_spare_moves_live_onto_its_own_node() -> None:
    """Issue 24: the node outlived its rank's fault and a replica holds the rank's state, so the
    node is its own spare: no step is lost (a restart in place went back to the checkpoint)."""
    plan = plan_recovery([CRASH], membership(False), workers(True), POLICY)

    assert plan.action == Action.LIVE and plan.promoted == (OTHER,) and plan.lost == (CRASH,)
    assert plan.membership == membership(False).next_epoch()
    assert plan.release == () and plan.stop == (OTHER,) and plan.returned == ()
    assert "no hot spare left for n2: its rank restarts there" in plan.detail


def test_a_crashed_rank_with_no_spare_restarts_in_place_when_it_cannot_move_live() -> None:
    off_loop = plan_recovery([CRASH], membership(False), workers(False), POLICY)
    sharded = dataclasses.replace(POLICY, layout=MeshLayout(("shard",), (6,), replicate=None))
    pure_fsdp = plan_recovery([CRASH], membership(False), workers(True), sharded)
    again = dataclasses.replace(POLICY, in_place_moves=3)
    repeated = plan_recovery([CRASH], membership(False), workers(True), again)

    for plan in (off_loop, pure_fsdp, repeated):
        assert plan.action == Action.RESTART_IN_PLACE
        assert plan.membership == membership(False).next_epoch()
        assert plan.release == () and plan.stop == (OTHER,)


def test_a_spare_takes_the_dead_node_and_the_crashed_one_is_its_own() -> None:
    """Two losses, one spare: the spare goes where only a spare can (the dead node)."""
    both = Membership(0, 1, (BATCH, OTHER, "n3", "n4"), ("s1",))
    facts = {n: WorkerFacts(live=True, running=True, usable=n != "n3") for n in (*both.active, "s1")}
    dead = Fault("n3", Detector.HEARTBEAT_LOST, "n3 silent for 1.2 s", evidence=Evidence.PROBE)

    plan = plan_recovery([CRASH, dead], both, facts, POLICY)

    assert plan.action == Action.LIVE and plan.promoted == (OTHER, "s1")
    assert plan.membership.active == (BATCH, OTHER, "s1", "n4") and plan.membership.failed == ("n3",)
    assert plan.release == ("n3",)


def test_a_spare_still_receiving_its_state_is_no_replica() -> None:
    """A fault during a live recovery: the spare promoted in it holds nothing yet. With the only
    other replica lost too, the lost ranks' state is nowhere: no live move, in place or not."""
    m = Membership(1, 1, (BATCH, OTHER, "s1"), ())
    also = dataclasses.replace(CRASH, node=BATCH)
    facts = {n: WorkerFacts(live=True, running=True, usable=True) for n in m.active}
    receiving = dataclasses.replace(POLICY, receiving=("s1",))

    assert plan_recovery([CRASH], m, facts, receiving).action == Action.LIVE  # b still holds it
    assert plan_recovery([CRASH, also], m, facts, POLICY).promoted == (OTHER, BATCH)  # s1 holds it
    orphaned = plan_recovery([CRASH, also], m, facts, receiving)
    assert orphaned.action == Action.RESTART_IN_PLACE


def test_in_place_restarts_are_bounded() -> None:
    policy = Policy(
        has_store=True, batch_host=BATCH, in_place_restarts=3, max_in_place_restarts=3, in_place_moves=3
    )

    plan = plan_recovery([CRASH], membership(False), workers(True), policy)

    assert (plan.action, plan.exit_code) == (Action.GIVE_UP, 137)
    assert "3 in-place restarts already" in plan.detail


def test_a_crash_on_a_node_slurm_calls_unusable_gives_up_without_a_spare() -> None:
    fault = Fault(OTHER, Detector.STEP_EXITED, "srun step on n2 exited with status 1", 1)

    plan = plan_recovery([fault], membership(False), workers(True, usable=False), POLICY)

    assert plan.action == Action.GIVE_UP


@pytest.mark.parametrize(
    "policy",
    [
        Policy(recovery=RecoveryPolicy.RESTART, has_store=True, batch_host=BATCH),
        Policy(recovery=RecoveryPolicy.LIVE, has_store=False, batch_host=BATCH),
    ],
    ids=["--recovery restart", "no rendezvous store"],
)
def test_without_live_migration_a_lost_node_restarts_on_the_spare(policy: Policy) -> None:
    plan = plan_recovery([FAULTS["unplanned"](OTHER)], membership(True), workers(True), policy)

    assert (plan.action, plan.promoted) == (Action.RESTART, ("s1",))


def test_a_survivor_still_starting_forces_a_restart() -> None:
    facts = workers(True) | {"n3": WorkerFacts(live=True, running=False)}

    plan = plan_recovery([FAULTS["unplanned"](OTHER)], membership(True), facts, POLICY)

    assert plan.action == Action.RESTART


def test_a_lost_spare_is_dropped() -> None:
    fault = Fault("s1", Detector.STEP_EXITED, "srun step on s1 exited with status 1", 1)

    plan = plan_recovery([fault], membership(True), workers(True), POLICY)

    assert (plan.action, plan.dropped, plan.stop) == (Action.DROP_SPARE, ("s1",), ("s1",))
    assert plan.membership == Membership(1, 2, (BATCH, OTHER, "n3"), (), ("s1",))


def test_a_drained_spare_is_dropped_with_its_reason() -> None:
    plan = plan_recovery([Fault("s1", Detector.DRAIN, "bad dimm")], membership(True), workers(True), POLICY)

    assert (plan.action, plan.dropped, plan.stop, plan.detail) == (
        Action.DROP_SPARE,
        ("s1",),
        (),
        "drained: bad dimm",
    )


def test_a_failed_collective_with_nobody_lost_regroups_the_same_members() -> None:
    fault = Fault(BATCH, Detector.COLLECTIVE_FAILED, "rank 0 on b: a collective failed (reset)")

    plan = plan_recovery([fault], membership(True), workers(True), POLICY)

    assert (plan.action, plan.detail, plan.stop, plan.release) == (Action.REGROUP, fault.detail, (), ())
    assert plan.membership == membership(True).next_epoch()


def test_a_failed_collective_and_a_lost_spare_regroup_in_one_epoch() -> None:
    faults = [
        Fault("s1", Detector.HEARTBEAT_LOST, "s1 went silent"),
        Fault(BATCH, Detector.COLLECTIVE_FAILED, "rank 0 on b: a collective failed"),
    ]

    plan = plan_recovery(faults, membership(True), workers(True), POLICY)

    assert (plan.action, plan.dropped, plan.release) == (Action.REGROUP, ("s1",), ("s1",))
    assert plan.membership == Membership(1, 2, (BATCH, OTHER, "n3"), (), ("s1",))


def test_a_node_lost_with_a_failed_collective_migrates_live() -> None:
    faults = [
        FAULTS["unplanned"](OTHER),
        Fault(BATCH, Detector.COLLECTIVE_FAILED, "rank 0 on b: a collective failed"),
    ]

    plan = plan_recovery(faults, membership(True), workers(True), POLICY)

    assert (plan.action, plan.promoted, plan.release) == (Action.LIVE, ("s1",), (OTHER,))


def test_two_nodes_lost_at_once_take_two_spares_in_one_epoch() -> None:
    m = Membership(3, 1, ("a", "b", "c"), ("s1", "s2"))
    faults = [
        Fault("c", Detector.NODE_DOWN, "Slurm reports c DOWN"),
        Fault("a", Detector.NODE_GONE, "Slurm no longer lists a in job 7"),
    ]

    plan = plan_recovery(
        faults, m, {n: WorkerFacts(True, True, True) for n in "abc"}, Policy(has_store=True, batch_host="x")
    )

    assert (plan.action, plan.promoted) == (Action.LIVE, ("s1", "s2"))
    assert plan.membership == Membership(4, 1, ("s2", "b", "s1"), (), ("c", "a"))
    assert plan.release == ("c",)  # node_gone: Slurm already took it out of the job


def test_one_spare_for_two_losses_gives_up_naming_the_loss_without_a_spare() -> None:
    m = Membership(0, 1, ("a", "b", "c"), ("s1",))
    faults = [
        Fault("b", Detector.NODE_DOWN, "Slurm reports b DOWN"),
        Fault("c", Detector.NODE_DOWN, "Slurm reports c DOWN"),
    ]

    plan = plan_recovery(faults, m, {}, Policy(has_store=True, batch_host="a"))

    assert plan.action == Action.GIVE_UP
    assert plan.detail.startswith("Slurm reports c DOWN; no hot spare left")


def test_a_warning_or_a_drain_on_a_node_that_left_does_nothing() -> None:
    m = Membership(1, 1, ("a", "s1"), (), ("n2",))
    for fault in (FAULTS["pre-emptive"]("n2"), FAULTS["planned"]("n2")):
        assert plan_recovery([fault], m, {}, POLICY).action == Action.NOTHING
    assert plan_recovery([], m, {}, POLICY).action == Action.NOTHING


def test_a_drain_of_a_node_whose_own_ranks_are_not_on_the_elastic_loop_is_deferred() -> None:
    """Its ranks would not hand over at the step boundary: the others would switch without them."""
    facts = workers(True) | {OTHER: WorkerFacts(live=False, running=True, usable=True)}

    plan = plan_recovery([FAULTS["planned"](OTHER)], membership(True), facts, POLICY)

    assert plan.action == Action.DEFER and "no live migration possible" in plan.detail


def test_a_stalled_recovery_restarts_every_rank_in_place_until_the_limit() -> None:
    m = membership(spare=True)
    stalled = Fault(
        BATCH, Detector.RECOVERY_STALLED, "the recovery to epoch 0 has not reached its first step"
    )

    plan = plan_recovery([stalled], m, workers(True), POLICY)
    assert (plan.action, plan.membership.active, plan.membership.epoch) == (
        Action.RESTART_IN_PLACE,
        m.active,
        1,
    )
    assert plan.lost == () and plan.stop == ()  # nobody is lost: everyone restarts

    exhausted = Policy(recovery=RecoveryPolicy.LIVE, has_store=True, batch_host=BATCH, in_place_restarts=3)
    plan = plan_recovery([stalled], m, workers(True), exhausted)
    assert plan.action == Action.GIVE_UP and "3 in-place restarts already" in plan.detail


#: A rank's fault on n2, by how it was seen: (detector, evidence).
RANK_FAULTS = {
    "process exited": (Detector.STEP_EXITED, Evidence.CONCLUSIVE),
    "rank hung, node beats": (Detector.RANK_HUNG, Evidence.PROGRESS),
    "process gone, node beats": (Detector.HEARTBEAT_LOST, Evidence.LOCAL_REPORT),
    "frozen, job stalled": (Detector.HEARTBEAT_LOST, Evidence.PROGRESS),
    "frozen, timeout": (Detector.HEARTBEAT_LOST, Evidence.TIMEOUT),
    "silent, peer saw a reset": (Detector.HEARTBEAT_LOST, Evidence.PEER_REPORT),
    "silent, slurmd unreachable": (Detector.HEARTBEAT_LOST, Evidence.PROBE),
}
#: (how, Slurm calls n2 usable) -> (n2 back to the pool with a spare, its own spare without one)
OUTLIVED_TABLE = [
    ("process exited", True, True, True),
    ("rank hung, node beats", True, True, True),
    ("process gone, node beats", True, True, True),
    ("frozen, job stalled", True, False, True),
    ("frozen, timeout", True, False, True),
    ("silent, peer saw a reset", True, False, False),
    ("silent, slurmd unreachable", True, False, False),
    *[(how, False, False, False) for how in RANK_FAULTS],
]


def rank_fault(how: str) -> Fault:
    detector, evidence = RANK_FAULTS[how]
    return Fault(
        OTHER,
        detector,
        f"n2: {how}",
        exit_code=137 if detector == Detector.STEP_EXITED else None,
        evidence=evidence,
    )


def test_the_outlived_table_covers_every_combination() -> None:
    assert {row[:2] for row in OUTLIVED_TABLE} == {(h, u) for h in RANK_FAULTS for u in (True, False)}


@pytest.mark.parametrize(("how", "usable", "returned", "in_place"), OUTLIVED_TABLE)
def test_a_node_that_outlived_its_ranks_fault_serves_the_job_again(
    how: str, usable: bool, returned: bool, in_place: bool
) -> None:
    """Issue 24, item 4: with a spare, a node that lost only its rank goes back to the pool
    (never released); without one, it is its own spare, after a hang as after a crash. A node
    that may be gone or cut off is neither."""
    fault, facts = rank_fault(how), workers(True, usable=usable)
    untrusted = fault.detector in (Detector.HEARTBEAT_LOST, Detector.RANK_HUNG)

    with_spare = plan_recovery([fault], membership(True), facts, POLICY)
    assert with_spare.action == Action.LIVE and with_spare.promoted == ("s1",)
    assert with_spare.returned == ((OTHER,) if returned else ())
    assert with_spare.release == ((OTHER,) if untrusted and not returned else ())
    assert with_spare.stop == (OTHER,)

    without = plan_recovery([fault], membership(False), facts, POLICY)
    assert without.action == (Action.LIVE if in_place else Action.GIVE_UP)
    if in_place:
        assert without.promoted == (OTHER,)
        assert without.release == () and without.stop == (OTHER,) and without.returned == ()
        assert without.membership == membership(False).next_epoch()


HOLDING = Policy(recovery=RecoveryPolicy.LIVE, has_store=True, batch_host=BATCH, spare_wait=300.0)
DEAD = Fault(OTHER, Detector.HEARTBEAT_LOST, "n2 silent for 1.2 s", evidence=Evidence.PROBE)


def test_a_dead_node_with_no_spare_holds_the_step_while_the_pool_can_refill() -> None:
    """Issue 24, item 3: a replica holds the lost rank's state, so the job waits for a node."""
    plan = plan_recovery([DEAD], membership(False), workers(True), HOLDING)

    assert plan.action == Action.HOLD
    assert plan.membership == membership(False) and plan.promoted == ()
    assert plan.lost == (DEAD,) and plan.stop == (OTHER,) and plan.release == (OTHER,)
    assert "holding the committed step for up to 300 s" in plan.detail


@pytest.mark.parametrize(
    ("why", "facts", "policy"),
    [
        ("no time left to wait (or a pool that cannot refill)", workers(True), POLICY),
        ("a survivor off the elastic loop", workers(False), HOLDING),
        (
            "pure FSDP: no replica of the lost shard",
            workers(True),
            dataclasses.replace(HOLDING, layout=MeshLayout(("shard",), (6,), replicate=None)),
        ),
    ],
)
def test_a_dead_node_with_no_spare_ends_the_job_when_holding_cannot_help(
    why: str, facts: dict[str, WorkerFacts], policy: Policy
) -> None:
    plan = plan_recovery([DEAD], membership(False), facts, policy)

    assert plan.action == Action.GIVE_UP, why
    assert "no hot spare left" in plan.detail


def test_a_crash_with_no_spare_moves_in_place_before_it_would_hold_and_holds_after_the_limits() -> None:
    first = plan_recovery([CRASH], membership(False), workers(True), HOLDING)
    moved = dataclasses.replace(HOLDING, in_place_moves=3)
    again = plan_recovery([CRASH], membership(False), workers(True), moved)
    spent = plan_recovery(
        [CRASH], membership(False), workers(True), dataclasses.replace(moved, in_place_restarts=3)
    )

    assert first.action == Action.LIVE and first.promoted == (OTHER,)
    assert again.action == Action.RESTART_IN_PLACE
    assert spent.action == Action.HOLD
