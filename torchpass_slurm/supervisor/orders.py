"""Orders: what the supervisor tells the workers, and the promotions that wait for a spare.

Every message the supervisor sends goes through :meth:`Orders.send`, best
effort: a worker that is gone is found by the detectors, not here. A
promotion is sent once every task of the spare's step said ``standby`` (at
once if they had), or when its step ended, or after ``startup_timeout``; the
loop calls :meth:`Orders.advance` on every pass, so nothing waits.

A live promotion carries the last copies of the rank state of the ranks the spare takes
(:class:`~.rankstates.RankStates`). In a planned move the leaving ranks keep training up to
the switch, so their copy of the switch step arrives after the plan: the promotion then
also waits for that copy (tagged with the switch step), for their ``released`` (sent after
it, on the same connection), or for the end of their step. The copy is enough: a sharded
leaving rank reports ``released`` only once it has handed its shards to the spare, which
needs the promotion first (``rank/handover.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torchpass_slurm.config import NodeRole
from torchpass_slurm.control.bodies import Promote, PromoteMode, Reconfigure, Stop
from torchpass_slurm.control.messages import Kind
from torchpass_slurm.control.schema import JSONObject
from torchpass_slurm.control.server import ControlServer
from torchpass_slurm.errors import ControlPlaneError
from torchpass_slurm.supervisor.context import JobContext
from torchpass_slurm.supervisor.workers import WorkerState, master_port

__all__ = ["Orders"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Promotion:
    """A spare to promote once every task of its step is on standby, or at ``deadline``."""

    mode: PromoteMode
    deadline: float
    #: a planned move with rank state: the leaving node and its ranks, whose copy of the switch
    #: step (or ``released``) comes first
    leaving: tuple[str, frozenset[int]] | None = None
    #: the step the leaving ranks switch after: their copy tagged with it is their last
    switch_after: int | None = None


class Orders:
    """The supervisor's messages to the workers of one job; see the module docstring."""

    def __init__(self, ctx: JobContext, *, server: ControlServer, store: tuple[str, int]) -> None:
        self.ctx = ctx
        self.job = ctx.job
        self.server = server
        self.store_addr, self.store_port = store
        self._promotions: dict[str, _Promotion] = {}
        self._released: set[int] = set()

    def promote(
        self,
        node: str,
        mode: PromoteMode,
        *,
        after: tuple[str, range] | None = None,
        switch_after: int | None = None,
    ) -> None:
        """Promote the spare once its step is on standby (now, if it already is); ``after``: a
        leaving node and its ranks, whose copy of step ``switch_after`` (or ``released``) the
        promotion waits for too."""
        deadline = self.ctx.clock.monotonic() + self.ctx.config.startup_timeout
        leaving = None if after is None else (after[0], frozenset(after[1]))
        self._promotions[node] = _Promotion(mode, deadline, leaving, switch_after)
        self.advance()

    def released(self, rank: object) -> None:
        """A rank of a drained node handed over and left (its last rank-state copy is here)."""
        if isinstance(rank, int):
            self._released.add(rank)

    def cancel(self, node: str) -> None:
        """Forget a promotion that waits for ``node`` (its step was lost)."""
        self._promotions.pop(node, None)

    def advance(self) -> None:
        """Send the promotions whose spares are ready (or whose wait is over)."""
        now = self.ctx.clock.monotonic()
        for node, pending in list(self._promotions.items()):
            step = self.job.steps[node]
            if not self._left(pending) and step.poll() is None:
                continue
            if step.all_standby() or step.poll() is not None or now >= pending.deadline:
                del self._promotions[node]
                self._send_promote(node, pending.mode)

    def _left(self, pending: _Promotion) -> bool:
        """Whether the leaving ranks' last rank-state copies are here (or they are gone)."""
        if pending.leaving is None:
            return True
        node, ranks = pending.leaving
        step = self.job.steps[node]
        gone = step.poll() is not None or step.state in (WorkerState.LOST, WorkerState.EXITED)
        return gone or ranks <= self._released or self._last_copies_here(ranks, pending.switch_after)

    def _last_copies_here(self, ranks: frozenset[int], switch_after: int | None) -> bool:
        if switch_after is None:
            return False
        return all(any(tag >= switch_after for tag, _ in self.job.rank_states.copies(r)) for r in ranks)

    def _send_promote(self, node: str, mode: PromoteMode) -> None:
        """Tell the spare's standby tasks their ranks; its step starts as an active one."""
        step, m = self.job.steps[node], self.job.membership
        step.role, step.epoch, step.state = NodeRole.ACTIVE, m.epoch, WorkerState.STARTING
        # a spare promoted live runs the elastic loop: a fault before its live_ready is planned
        # with it as a rank that can rebuild (it holds no replica until its state has come)
        step.live = step.live or mode == PromoteMode.LIVE
        step.heartbeats.clear()
        step.hello_senders.clear()
        step.started = self.ctx.clock.time()
        for sender in sorted(step.standby_senders):
            local = int(sender.rsplit("/", 1)[1])
            rank = m.rank_base(node) + local
            body = Promote(
                rank=rank,
                local_rank=local,
                world_size=m.world_size,
                master_addr=m.node_of_rank(0),
                master_port=master_port(self.job.job_id, m.epoch),
                epoch=m.epoch,
                mode=mode,
                store_addr=self.store_addr,
                store_port=self.store_port,
                rank_state=self.job.rank_states.copies(rank) if mode == PromoteMode.LIVE else (),
            )
            self.send(sender, Kind.PROMOTE, body.to_body())

    def reconfigure(
        self, nodes: list[str], *, leave: tuple[int, ...] | None = None, switch_after: int | None = None
    ) -> None:
        """Tell the ranks on ``nodes`` to rebuild their group for the current epoch.

        ``leave``: a planned migration; these ranks hand over and leave, and every rank
        switches after committing step ``switch_after``.
        """
        m = self.job.membership
        body = Reconfigure(
            epoch=m.epoch,
            world_size=m.world_size,
            store_addr=self.store_addr,
            store_port=self.store_port,
            planned=leave is not None,
            leave=leave or (),
            switch_after=switch_after,
        ).to_body()
        for node in nodes:
            step = self.job.steps[node]
            step.epoch = m.epoch
            for sender in sorted(step.hello_senders):
                self.send(sender, Kind.RECONFIGURE, body)

    def stop_standby(self, node: str, reason: str) -> None:
        """Tell every standby task of ``node``'s step to leave."""
        step = self.job.steps.get(node)
        for sender in step.standby_senders if step is not None else ():
            self.send(sender, Kind.STOP, Stop(reason).to_body())

    def send(self, sender: str, kind: Kind, body: JSONObject) -> None:
        """Best effort: a worker that is gone is found by the detectors, not here."""
        peer = self.server.peer_of(sender)
        if peer is None:
            logger.warning("cannot send %s to %s: never connected", kind, sender)
            return
        try:
            self.server.send(peer, kind, body)
        except ControlPlaneError as err:
            logger.warning("cannot send %s to %s: %s", kind, sender, err)
