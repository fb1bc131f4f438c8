"""The recovery planner: faults plus membership in, one typed :class:`Plan` out. Pure.

Every recovery decision of the supervisor is made here, in
:func:`plan_recovery`; the loop (:mod:`.loop`) only gathers the facts and
carries the plan out. The decision, for the faults of one detection::

    fault class    the node is      and                                       plan
    unplanned      a spare          -                                         drop the spare
    unplanned      active           every survivor on the elastic loop,       live migration
                                    a store, --recovery live, a spare each,
                                    a surviving replica of every lost rank
    unplanned      active           as above, but a lost rank's every         restart on spares
                                    replica lost too (pure FSDP: always)      (fallback "no replica")
    unplanned      active           too few spares, but every lost node a     live migration,
                                    spare cannot take outlived its rank's     in place (its rank
                                    fault (a crash, a hang; Slurm calls it    restarts there and
                                    usable), live migration otherwise         receives the state)
                                    possible
    unplanned      active           enough spares (else: every lost node      restart on spares
                                    outlived its rank's fault, a crash or a   (restart in place)
                                    hang, and Slurm calls it usable)
    unplanned      active           no spare and no in-place restart, but     hold (for up to
                                    live migration possible once a spare is    spare_wait s)
                                    there, and the pool can refill
    unplanned      active           no spare, a node dead, or too many        give up
                                    in-place restarts
    unplanned      - (a collective failed and the settle blamed nobody)       regroup
    unplanned      - (a recovery stalled past recovery_timeout)               restart in place
                                                                              (give up past the limit)
    pre-emptive    active           -                                         drain it (its drain moves it)
    planned        a spare          -                                         drop the spare
    planned        active           not the batch host, live migration        planned migration
                                    possible, its own ranks on the loop too
    planned        active           the batch host, or no live migration      defer (to the job's end)

A spare lost together with an active node is dropped by the same plan. A
plan that changes the membership moves it to the next epoch, once.

A lost node that outlived its rank's fault (:func:`outlived`: the process
exited, or the rank hung while its node's heartbeats went on, and Slurm calls
the node usable) is not released: a live migration or a restart on spares
gives it back to the spare pool (``returned``). With no spare left for it, it is
its own spare: a live migration in place, where its rank restarts and receives
the state from a replica (no step lost), else a checkpoint restart in place. A
silent node is never given back (it may be cut off); with no spare left it is
restarted on only when its rank froze (evidence ``progress`` or ``timeout``: its
slurmd was not found unreachable). Live moves in place that repeat without the
job's committed step moving are bounded as restarts in place are (a crash that
repeats is a bug).

A fault during a recovery is planned on the membership of the recovery in flight:
a spare promoted live in it is on the elastic loop, but until its state has come
it holds no replica (``Policy.receiving``).

Replicas come from the job's device mesh (:class:`~torchpass_slurm.mesh.MeshLayout`,
reported by sharded ranks; DDP is the mesh ``("replicate",)`` of the world). A planned or
pre-emptive move stays live on every mesh: the leaving rank is alive and sends its own shards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torchpass_slurm.faults import (
    NODE_UNTRUSTED,
    Detector,
    Evidence,
    Fault,
    FaultClass,
    Recovery,
    RecoveryPolicy,
    pre_emptive_drain_reason,
)
from torchpass_slurm.mesh import MeshLayout
from torchpass_slurm.strenum import StrEnum
from torchpass_slurm.supervisor.membership import Membership

__all__ = ["Action", "Plan", "Policy", "WorkerFacts", "plan_recovery", "outlived", "NO_REPLICA"]

#: With no spare left, how often a job may restart in place (a crash that repeats is a bug).
MAX_IN_PLACE_RESTARTS = 3
#: The fallback of a live migration that could not be: a lost rank's state exists nowhere else.
NO_REPLICA = "no replica"
#: Evidence that a silent rank froze on a node that is up (the job stalled around it, or nothing
#: confirmed a loss of the node: its slurmd was not found unreachable).
FROZEN = frozenset({Evidence.PROGRESS, Evidence.TIMEOUT})


class Action(StrEnum):
    """What a plan does. The first five are :class:`~torchpass_slurm.faults.Recovery` modes."""

    LIVE = Recovery.LIVE.value
    PLANNED = Recovery.PLANNED.value
    RESTART = Recovery.RESTART.value
    RESTART_IN_PLACE = Recovery.RESTART_IN_PLACE.value
    REGROUP = Recovery.REGROUP.value
    HOLD = "hold"
    DROP_SPARE = "drop-spare"
    DRAIN = "drain"
    DEFER = "defer"
    GIVE_UP = "give-up"
    NOTHING = "nothing"

    @property
    def recovery(self) -> Recovery | None:
        """The recovery mode this action starts (``migration_started``'s mode), if any."""
        try:
            return Recovery(self.value)
        except ValueError:
            return None


@dataclass(frozen=True)
class WorkerFacts:
    """What the planner needs to know of one node's step."""

    #: its ranks run the elastic loop (they reported live_ready)
    live: bool = False
    #: its step is running (all its tasks said hello)
    running: bool = False
    #: Slurm's last word on the node: usable (not down, not failing)
    usable: bool = False


@dataclass(frozen=True)
class Policy:
    """The job's standing choices and counters that bound what a plan may do."""

    recovery: RecoveryPolicy = RecoveryPolicy.LIVE
    #: a rendezvous store on the batch host (needed to rebuild groups in place)
    has_store: bool = False
    #: the node that runs the supervisor (it cannot leave the job)
    batch_host: str = ""
    #: in-place restarts done so far
    in_place_restarts: int = 0
    max_in_place_restarts: int = MAX_IN_PLACE_RESTARTS
    #: the job's device mesh (None: DDP, every rank a replica of every other)
    layout: MeshLayout | None = None
    #: how long the job may still hold its committed step for a spare (0: it may not;
    #: ``supervisor/hold.py``)
    spare_wait: float = 0.0
    #: nodes promoted live in the recovery in flight, their state not yet received: no
    #: replica of anything
    receiving: tuple[str, ...] = ()
    #: live moves in place since the job's committed step last moved
    in_place_moves: int = 0

    def mesh(self, world_size: int) -> MeshLayout:
        """The job's mesh; DDP over ``world_size`` when none fits (none was reported)."""
        layout = self.layout
        return (
            layout if layout is not None and layout.world_size == world_size else MeshLayout.ddp(world_size)
        )


@dataclass(frozen=True)
class Plan:
    """One recovery decision.

    ``membership`` is the membership after the plan (the next epoch when it
    changes anything). ``lost`` are the faults of active nodes whose slots
    move, ``promoted`` the spares that take them (in the same order),
    ``dropped`` the spares that leave the pool, ``release`` the nodes to take
    out of the allocation once the recovery has started, ``stop`` the nodes
    whose lost steps are stopped first, ``returned`` the lost nodes that rejoin the spare
    pool once their old step has ended (:func:`outlived`).
    """

    action: Action
    membership: Membership
    faults: tuple[Fault, ...] = ()
    lost: tuple[Fault, ...] = ()
    promoted: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    release: tuple[str, ...] = ()
    returned: tuple[str, ...] = ()
    detail: str = ""
    exit_code: int = 1
    #: why a recovery that could have been live is not (:data:`NO_REPLICA`), else ""
    fallback: str = ""

    @property
    def lost_nodes(self) -> list[str]:
        """The active nodes whose slots move, in the order of :attr:`promoted`."""
        return [f.node for f in self.lost]

    @property
    def drained(self) -> bool:
        """The plan answers an admin drain (a planned fault)."""
        return any(f.detector == Detector.DRAIN for f in self.faults)

    @property
    def stop(self) -> tuple[str, ...]:
        """Nodes whose steps are lost: stopped before anything else happens."""
        return tuple(f.node for f in self.faults if f.loses_node)


def plan_recovery(
    faults: Sequence[Fault], membership: Membership, workers: Mapping[str, WorkerFacts], policy: Policy
) -> Plan:
    """The one plan for ``faults`` (of one detection) in ``membership``; see the module doc."""
    faults = tuple(faults)
    if not faults:
        return Plan(Action.NOTHING, membership)
    classes = {f.fault_class for f in faults}
    if classes == {FaultClass.PLANNED}:
        return _plan_drain(faults[0], membership, workers, policy)
    if classes == {FaultClass.PRE_EMPTIVE}:
        return _plan_warning(faults[0], membership)
    return _plan_unplanned(
        tuple(f for f in faults if f.fault_class == FaultClass.UNPLANNED), membership, workers, policy
    )


def outlived(fault: Fault, workers: Mapping[str, WorkerFacts]) -> bool:
    """``fault`` lost a rank, not its node: Slurm calls the node usable, and the rank's process
    exited, or the rank hung while the node's heartbeats went on, or the node's local rank 0
    found the process gone. Such a node can serve the job again."""
    if not workers.get(fault.node, WorkerFacts()).usable:
        return False
    return fault.detector in (Detector.STEP_EXITED, Detector.RANK_HUNG) or (
        fault.evidence == Evidence.LOCAL_REPORT
    )


def _restartable(fault: Fault, workers: Mapping[str, WorkerFacts]) -> bool:
    """With no spare left, the job may restart in place on ``fault``'s node: it outlived the
    fault, or its rank froze (:data:`FROZEN`) on a node Slurm calls usable."""
    return outlived(fault, workers) or (
        fault.detector == Detector.HEARTBEAT_LOST
        and fault.evidence in FROZEN
        and workers.get(fault.node, WorkerFacts()).usable
    )


def can_migrate_live(
    lost: Sequence[str], membership: Membership, workers: Mapping[str, WorkerFacts], policy: Policy
) -> bool:
    """Every surviving active rank runs the elastic loop, and there is a spare per lost node."""
    return _survivors_can_rebuild(lost, membership, workers, policy) and len(membership.spares) >= len(lost)


def _survivors_can_rebuild(
    lost: Sequence[str], membership: Membership, workers: Mapping[str, WorkerFacts], policy: Policy
) -> bool:
    """Live migration is the policy, a store exists, and every surviving active rank runs the
    elastic loop: the survivors can rebuild their group in place (once a spare is there)."""
    survivors = [n for n in membership.active if n not in lost]
    facts = [workers.get(n, WorkerFacts()) for n in survivors]
    return (
        policy.recovery == RecoveryPolicy.LIVE
        and policy.has_store
        and bool(survivors)
        and all(w.live and w.running for w in facts)
    )


def _plan_unplanned(
    faults: tuple[Fault, ...], membership: Membership, workers: Mapping[str, WorkerFacts], policy: Policy
) -> Plan:
    losses = [f for f in faults if f.loses_node]
    dropped = tuple(f.node for f in losses if f.node in membership.spares)
    lost = tuple(f for f in losses if f.node in membership.active)
    release = tuple(f.node for f in losses if f.detector in NODE_UNTRUSTED and f.node != policy.batch_host)
    after_drop = membership.without_spares(dropped) if dropped else membership
    base = Plan(Action.NOTHING, membership, faults=faults, lost=lost, dropped=dropped, release=release)
    if not lost:
        stalled = [f for f in faults if f.detector == Detector.RECOVERY_STALLED]
        if stalled:
            return _plan_stalled(dataclasses.replace(base, membership=after_drop), stalled[0], policy)
        if any(f.detector == Detector.COLLECTIVE_FAILED for f in faults):
            detail = next(f.detail for f in faults if f.detector == Detector.COLLECTIVE_FAILED)
            return dataclasses.replace(
                base, action=Action.REGROUP, detail=detail, membership=after_drop.next_epoch(membership.epoch)
            )
        if dropped:
            return dataclasses.replace(base, action=Action.DROP_SPARE, membership=after_drop)
        return base
    nodes = [f.node for f in lost]
    if len(after_drop.spares) >= len(lost):
        returned = tuple(f.node for f in lost if outlived(f, workers))
        base = dataclasses.replace(
            base, returned=returned, release=tuple(n for n in release if n not in returned)
        )
        live = can_migrate_live(nodes, after_drop, workers, policy)
        orphans = _without_replica(nodes, membership, policy) if live else []
        if orphans:
            base = dataclasses.replace(
                base,
                fallback=NO_REPLICA,
                detail=f"{NO_REPLICA}: rank(s) {', '.join(map(str, orphans))} lost with every replica "
                "of their state; restarting from the checkpoint",
            )
        return _onto_spares(base, Action.LIVE if live and not orphans else Action.RESTART, after_drop, nodes)
    in_place = _live_in_place(base, after_drop, workers, policy)
    if in_place is not None:
        return in_place
    first = lost[len(after_drop.spares)]  # the first loss no spare is left for
    crashed = all(_restartable(f, workers) for f in lost)
    if crashed and policy.in_place_restarts < policy.max_in_place_restarts:
        return dataclasses.replace(
            base,
            action=Action.RESTART_IN_PLACE,
            membership=after_drop.next_epoch(membership.epoch),
            release=tuple(n for n in release if n not in nodes),  # restarted on, not released
        )
    if (
        policy.spare_wait > 0
        and _survivors_can_rebuild(nodes, after_drop, workers, policy)
        and not _without_replica(nodes, membership, policy)
    ):
        return dataclasses.replace(
            base,
            action=Action.HOLD,
            membership=after_drop,
            detail=f"{first.detail}; no hot spare left: holding the committed step for up to "
            f"{policy.spare_wait:.0f} s while the spare pool refills",
        )
    if crashed:
        detail = (
            f"{first.detail}; no hot spare left and {policy.in_place_restarts} in-place "
            "restarts already: giving up (submit with more --spares)"
        )
    else:
        detail = f"{first.detail}; no hot spare left, the job cannot continue (submit with more --spares)"
    return dataclasses.replace(base, action=Action.GIVE_UP, detail=detail, exit_code=first.exit_code or 1)


def _without_replica(lost: Sequence[str], membership: Membership, policy: Policy) -> list[int]:
    """The lost nodes' ranks, and those of the spares still receiving their state (they hold
    none yet), that no other surviving rank holds a replica of (by the job's mesh)."""
    ranks = [r for node in lost for r in membership.ranks_of(node)]
    empty = [r for node in policy.receiving if node in membership.active for r in membership.ranks_of(node)]
    return policy.mesh(membership.world_size).without_replica([*ranks, *empty])


def _live_in_place(
    base: Plan, pool: Membership, workers: Mapping[str, WorkerFacts], policy: Policy
) -> Plan | None:
    """Too few spares: the lost nodes that outlived their rank's fault are their own spares, a
    live migration in place (the spares take the others' slots), when every other condition
    of a live migration holds; else None."""
    lost = base.lost
    own = [f for f in lost if _restartable(f, workers)]
    others = [f.node for f in lost if f not in own]
    nodes = [f.node for f in lost]
    if (
        not own
        or len(pool.spares) < len(others)
        or policy.in_place_moves >= policy.max_in_place_restarts
        or not _survivors_can_rebuild(nodes, pool, workers, policy)
        or _without_replica(nodes, base.membership, policy)
    ):
        return None
    new = pool.replace_all(others, epoch=base.membership.epoch + 1)
    promoted = tuple(new.active[base.membership.slot_of(n)] for n in nodes)
    where = ", ".join(f.node for f in own)
    return dataclasses.replace(
        base,
        action=Action.LIVE,
        membership=new,
        promoted=promoted,
        release=tuple(n for n in base.release if n not in promoted),
        detail=f"{own[0].detail}; no hot spare left for {where}: its rank restarts there and "
        "receives the state live from a replica",
    )


def _plan_stalled(base: Plan, fault: Fault, policy: Policy) -> Plan:
    """A recovery that cannot finish: every rank restarts in place from the checkpoint."""
    if policy.in_place_restarts < policy.max_in_place_restarts:
        return dataclasses.replace(
            base,
            action=Action.RESTART_IN_PLACE,
            detail=fault.detail,
            membership=base.membership.next_epoch(base.membership.epoch),
        )
    detail = f"{fault.detail}; {policy.in_place_restarts} in-place restarts already: giving up"
    return dataclasses.replace(base, action=Action.GIVE_UP, detail=detail)


def _plan_warning(fault: Fault, membership: Membership) -> Plan:
    """A health warning: drain the node while it still works; the drain then moves it."""
    if fault.node not in membership.active:
        return Plan(Action.NOTHING, membership, faults=(fault,))
    reason = pre_emptive_drain_reason(fault.detail)
    return Plan(Action.DRAIN, membership, faults=(fault,), detail=reason)


def _plan_drain(
    fault: Fault, membership: Membership, workers: Mapping[str, WorkerFacts], policy: Policy
) -> Plan:
    """An admin drain: move the node's ranks at a step boundary, or defer to the job's end."""
    node, reason = fault.node, fault.detail
    if node in membership.spares:
        return Plan(
            Action.DROP_SPARE,
            membership.without_spares([node]),
            faults=(fault,),
            dropped=(node,),
            detail=f"drained: {reason}",
        )
    if node not in membership.active:
        return Plan(Action.NOTHING, membership, faults=(fault,))
    if node == policy.batch_host:
        return Plan(
            Action.DEFER,
            membership,
            faults=(fault,),
            detail="the batch host runs the supervisor and cannot leave the job: it drains when the job ends",
        )
    leaver = workers.get(node, WorkerFacts())
    if not (leaver.live and can_migrate_live([node], membership, workers, policy)):
        return Plan(
            Action.DEFER,
            membership,
            faults=(fault,),
            detail="no live migration possible (no spare, or a rank not on the elastic "
            "loop): the node drains when the job ends",
        )
    return _onto_spares(
        Plan(Action.PLANNED, membership, faults=(fault,), lost=(fault,), detail=reason),
        Action.PLANNED,
        membership,
        [node],
    )


def _onto_spares(base: Plan, action: Action, pool: Membership, nodes: Sequence[str]) -> Plan:
    """``base`` as ``action``: the first spares of ``pool`` take the lost nodes' slots, one epoch on."""
    new = pool.replace_all(nodes, epoch=base.membership.epoch + 1)
    promoted = tuple(new.active[base.membership.slot_of(n)] for n in nodes)
    return dataclasses.replace(base, action=action, membership=new, promoted=promoted)
