"""The handover after a new epoch's group is up: agree on the committed step, move the state.

One algorithm for every layout: DDP is the mesh ``("replicate",)`` of the world
(:meth:`~torchpass_slurm.mesh.MeshLayout.ddp`), FSDP2 and HSDP are the user's mesh. What a
rank's state is, how it is read, judged and loaded, is the injected
:class:`~torchpass_slurm.rank.training_state.TrainingState`. :meth:`Handover.sync` is the
"agree" and "transfer" of the recovery path (``rank/elastic.py``)::

    agree       all-gather (committed step, the ranks leaving by a planned drain);
                S = the highest step
    plan        each rank behind S (a promoted spare: step -1, rarely a survivor) gets one donor:
                  the rank leaving its logical rank, when a drain announced it and the state
                  serves itself on leaving (sharded: pure FSDP too)
                  else a replica at S holding the same shard coordinate (assign_donors:
                  spread over the replica groups in rank order; the state's ``avoid`` ranks,
                  a sharded job's rank 0, only as the last choice)
                  else nobody: NoReplicaError on every rank (restart from a checkpoint)
    transfer    the donor streams what the state gives (DDP: full state_dicts; sharded: its
                own local shards with their specs in the manifest's meta); the receiver judges
                the manifest before one byte is written, then loads what it received
    barrier     every rank waits for the transfers (a monitored barrier on gloo)

A replica donor is in the new epoch's group (``TorchTransport``). A leaving rank is not:
it left the group at the switch, so it listens on a TCP socket of its own, bound to its
address on the job's network, and publishes ``host:port:tag`` in the job's rendezvous store
under ``epoch<N>/torchpass/shard_donor/<rank>`` (:class:`LeavingDonor`). The tag is a MAC
of the address with the transfer's seal: the receiver refuses an address that an outsider
wrote, connects, answers the donor's challenge with the same seal and receives a sealed
stream (:func:`connect_to_leaving`). The listener takes one peer and closes. Both sides wait
at most :data:`PLANNED_HANDOVER_TIMEOUT` for each other.

Every stream is sealed with the job's key (``transfer/seal.py``): bytes that do not come
from a rank of this job are refused before they become training state. A DDP receiver's
progress survives a donor's death: the next epoch's transfer resumes from the chunks
already verified (``transfer.ReceiveProgress``; the state's ``resumable``).
"""

from __future__ import annotations

import datetime
import logging
import socket
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torchpass_slurm import config as cfg
from torchpass_slurm.control.messages import ReportKind
from torchpass_slurm.errors import NoReplicaError, TransferError
from torchpass_slurm.mesh import MeshLayout, assign_donors
from torchpass_slurm.rank.group import destroy_group
from torchpass_slurm.rank.routes import ROUTE_KEY, receive_routed, route_of, send_routed
from torchpass_slurm.rank.runtime import Runtime

if TYPE_CHECKING:
    from torchpass_slurm.control.bodies import Reconfigure
    from torchpass_slurm.rank.training_state import TrainingState
    from torchpass_slurm.transfer import TransferStats, Transport
    from torchpass_slurm.transfer.seal import Seal

__all__ = [
    "Handover",
    "Agreement",
    "plan_donors",
    "report_transfer",
    "LeavingDonor",
    "connect_to_leaving",
    "TRANSFER_TIMEOUT",
    "PLANNED_HANDOVER_TIMEOUT",
    "DONOR_KEY",
]

logger = logging.getLogger(__name__)

#: Timeout of one state transfer call.
TRANSFER_TIMEOUT = datetime.timedelta(seconds=120)
#: How long a rank leaving by a drain waits for the spare that takes its rank to connect and
#: receive its shards, and how long that spare waits for the leaving rank's address.
PLANNED_HANDOVER_TIMEOUT = datetime.timedelta(seconds=120)
#: The store key (under the epoch's prefix) where a leaving rank publishes its listener.
DONOR_KEY = "torchpass/shard_donor/{rank}"


@dataclass(frozen=True)
class Agreement:
    """What the all-gather of the new epoch told every rank."""

    committed: int
    held: tuple[int, ...]  # each rank's committed step
    leaving: frozenset[int]  # logical ranks whose previous holder leaves by a drain

    @property
    def receivers(self) -> list[int]:
        return [r for r, s in enumerate(self.held) if s < self.committed]

    @property
    def holders(self) -> list[int]:
        return [r for r, s in enumerate(self.held) if s == self.committed]


def plan_donors(layout: MeshLayout, agreement: Agreement, avoid: Collection[int] = (0,)) -> dict[int, int]:
    """Receiver -> donor rank. A receiver whose rank is leaving gets the leaving rank itself
    (the same number: the process outside the group); the others a replica at the agreed
    step. A receiver left out has no donor. Pure: every rank computes the same plan."""
    plan = {r: r for r in agreement.receivers if r in agreement.leaving}
    rest = [r for r in agreement.receivers if r not in plan]
    plan.update(assign_donors(layout, rest, agreement.holders, avoid=avoid))
    return plan


def report_transfer(
    rt: Runtime, donor: int, step: int, stats: TransferStats, *, sealed: bool, **extra: Any
) -> None:
    """``transfer_done``: this rank received the state of ``step`` from ``donor`` (``sealed``:
    authenticated with the job's key)."""
    rt.report(
        ReportKind.TRANSFER_DONE,
        donor=donor,
        receiver=rt.rank,
        step=step,
        bytes=stats.bytes,
        seconds=round(stats.seconds, 4),
        retries=stats.retries,
        resumed_from=stats.resumed_from,
        epoch=rt.epoch,
        sealed=sealed,
        **extra,
    )


class Handover:
    """Agreement and state transfer for one rank whose state is ``training`` (module doc)."""

    def __init__(self, rt: Runtime, training: TrainingState) -> None:
        self.rt = rt
        self.training = training
        #: True once this rank received the training state from a donor
        self.received = False
        #: bytes this rank received in its last transfer
        self.received_bytes = 0
        self._progress: Any = None  # transfer progress, kept across a donor's death (resumable)
        #: the job's transport setting (TORCHPASS_TRANSPORT): the route of a replica donor
        self.route = route_of(cfg.transport_from_env())

    def agree(self, step: int, leaving: Collection[int]) -> Agreement:
        import torch
        import torch.distributed as dist

        world = dist.get_world_size()
        mine = torch.zeros(1 + world, dtype=torch.int64)
        mine[0] = step
        for r in leaving:
            mine[1 + r] = 1
        gathered = [torch.zeros(1 + world, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(gathered, mine)
        held = tuple(int(t[0]) for t in gathered)
        flags = torch.stack(gathered)[:, 1:].amax(dim=0)
        return Agreement(max(held), held, frozenset(int(r) for r in flags.nonzero().flatten()))

    def sync(self, step: int, leaving: Collection[int] = ()) -> int:
        """Agree; ranks behind the agreed step receive their state. The agreed step.

        ``leaving``: the ranks a planned drain takes out, which serve their own state to the
        spares taking them when the state says so (``leaving_donor``); ignored otherwise."""
        import torch.distributed as dist

        agreement = self.agree(step, leaving if self.training.leaving_donor else ())
        layout = self.training.layout(len(agreement.held))
        plan = plan_donors(layout, agreement, avoid=self.training.avoid)
        if self.rt.rank == 0:
            self.rt.report(
                ReportKind.AGREEMENT,
                committed_step=agreement.committed,
                receivers=agreement.receivers,
                **self.training.agreement_fields(agreement.holders, plan, agreement.leaving),
                epoch=self.rt.epoch,
            )
        lost = [r for r in agreement.receivers if r not in plan]
        if lost:
            raise NoReplicaError(
                f"no replica holds the shards of rank(s) {lost} at step {agreement.committed} "
                f"(mesh {dict(zip(layout.dims, layout.shape, strict=True))}, "
                f"replicate dimension {layout.replicate!r}): they cannot be moved live",
                hint="restart the job from its newest checkpoint with the same mesh",
            )
        for recv, donor in sorted(plan.items()):
            if self.rt.rank == recv:
                self._receive(donor, agreement.committed, leaving=recv in agreement.leaving)
            elif self.rt.rank == donor and recv not in agreement.leaving:
                self._send(recv, agreement.committed)
        # Ranks outside the transfer wait here for as long as a transfer may take,
        # not just one collective's timeout.
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=TRANSFER_TIMEOUT)
        else:  # monitored_barrier is gloo-only; the group's collective timeout applies
            dist.barrier()
        return agreement.committed

    def _send(self, receiver: int, step: int) -> None:
        from torchpass_slurm.transfer import TorchTransport, send_state

        state, meta = self.training.outgoing(self.rt.rank, step)
        seal = self.rt.transfer_seal(self.rt.epoch, step, self.rt.rank, receiver)
        route = self._route_store(seal)
        if route is None or seal is None:
            stats = send_state(
                TorchTransport(receiver), state, timeout=TRANSFER_TIMEOUT, meta=meta, seal=seal
            )
            via = "group"
        else:
            store, host = route
            key = ROUTE_KEY.format(donor=self.rt.rank, receiver=receiver)
            stats, via = send_routed(
                self.route, store, key, seal, host, state, meta, lambda: TorchTransport(receiver), self.rt.log
            )
        self.rt.log.info("sent the state of step %d to rank %d via %s: %s", step, receiver, via, stats)

    def _route_store(self, seal: Seal | None) -> tuple[Any, str] | None:
        """This epoch's view of the job's store and this host's address on the job's network
        when the transfer takes a route of its own (``rank/routes.py``), else None: the group
        (no setting for one, or no store or secret: not under tp run)."""
        info = self.rt.info
        if (
            self.route == "group"
            or seal is None
            or info is None
            or not info.store_addr
            or not info.store_port
        ):
            return None
        addr, port = info.store_addr, int(info.store_port)
        base, store = _epoch_store(self.rt.job_store, addr, port, self.rt.epoch, PLANNED_HANDOVER_TIMEOUT)
        self._store_base = base  # kept alive while the view is in use (_epoch_store)
        return store, _reachable_host(addr, port)

    def _receive(self, donor: int, step: int, *, leaving: bool) -> None:
        from torchpass_slurm.transfer import ReceiveProgress, TorchTransport

        into, accept = self.training.incoming(self.rt.rank, donor, step)  # filled in place
        if self.training.resumable and self._progress is None:
            self._progress = ReceiveProgress()
        seal = self.rt.transfer_seal(self.rt.epoch, step, donor, self.rt.rank)
        route = None if leaving else self._route_store(seal)
        if route is not None and seal is not None:
            store = route[0]
            key = ROUTE_KEY.format(donor=donor, receiver=self.rt.rank)
            received, stats, via = receive_routed(
                self.route,
                store,
                key,
                seal,
                lambda: TorchTransport(donor),
                into=into,
                progress=self._progress,
                accept=accept,
                log=self.rt.log,
            )
        else:
            received, stats = self._receive_over(donor, seal, leaving, into, accept)
            via = "socket" if leaving else "group"
        self.training.load(received)
        self._progress = None
        self.received = True
        self.received_bytes = stats.bytes
        report_transfer(
            self.rt,
            donor,
            step,
            stats,
            sealed=seal is not None,
            **{"via": via, **self.training.transfer_fields(via)},
        )

    def _receive_over(self, donor: int, seal: Seal | None, leaving: bool, into: Any, accept: Any) -> Any:
        """Receive from ``donor`` over the group, or from a leaving donor over its socket."""
        from torchpass_slurm.transfer import TorchTransport, recv_state

        if leaving:
            transport: Transport = connect_to_leaving(self.rt, donor, seal)
        else:
            transport = TorchTransport(donor)
        try:
            return recv_state(
                transport,
                timeout=TRANSFER_TIMEOUT,
                into=into,
                progress=self._progress,
                accept=accept,
                seal=seal,
            )
        finally:
            if leaving:
                transport.close()

    def leave(self, body: Reconfigure, step: int) -> None:
        """This rank leaves by the drain ``body`` at ``step``: its old group goes (no peer waits on
        it). Where the state serves itself on leaving (``leaving_donor``: sharded), its own state
        is read first (a local copy, no group needed) and then sent to the spare taking its rank,
        which finds this rank through the store. A handover that fails is logged: the spare's
        own handover then fails, and the supervisor decides the next step. A DDP rank just
        leaves: a replica serves the spare."""
        rank = self.rt.rank
        outgoing = self.training.outgoing(rank, step) if self.training.leaving_donor else None
        destroy_group(self.rt.log)
        if outgoing is None:
            return
        try:
            seal = self.rt.transfer_seal(body.epoch, step, rank, rank)
            donor = LeavingDonor(rank, body.epoch, body.store_addr, body.store_port, seal, self.rt.job_store)
            stats = donor.serve(*outgoing)
            self.rt.log.info("handed my shards of step %d to the spare: %s", step, stats)
        except TransferError as exc:
            self.rt.log.error("could not hand my shards of step %d to the spare: %s", step, exc)


# --- a rank leaving by a drain, and the spare that takes its rank ------------------------


#: Opens the job's store: (address, port, timeout) -> a torch Store (``Runtime.job_store``).
StoreOpener = Callable[[str, int, datetime.timedelta], Any]


def _epoch_store(
    open_store: StoreOpener, addr: str, port: int, epoch: int, timeout: datetime.timedelta
) -> tuple[Any, Any]:
    """The job's store and its view under ``epoch<N>``. Keep the first referenced while the
    view is in use: torch's ``PrefixStore`` does not keep a store written in Python alive."""
    import torch.distributed as dist

    base = open_store(addr, port, timeout)
    return base, dist.PrefixStore(f"epoch{epoch}", base)


def _reachable_host(store_addr: str, store_port: int) -> str:
    """This host's address on the route to the store (the job's network), else its name."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((store_addr, store_port))  # UDP: no packet is sent
            return str(probe.getsockname()[0])
    except OSError:
        return socket.gethostname()


class LeavingDonor:
    """A rank leaving by a drain: it sends its own shards to the spare taking its rank."""

    def __init__(
        self,
        rank: int,
        epoch: int,
        store_addr: str,
        store_port: int,
        seal: Seal | None,
        open_store: StoreOpener,
    ) -> None:
        if seal is None:
            raise TransferError(
                f"rank {rank} cannot hand its shards over: it has no job secret to seal them with",
                hint="planned migrations run under tp run, which gives every rank the job's secret",
            )
        self.rank, self.epoch, self.seal = rank, epoch, seal
        self.store_addr, self.store_port = store_addr, store_port
        self.open_store = open_store

    def serve(
        self, state: Mapping[str, Any], meta: Any, timeout: datetime.timedelta = PLANNED_HANDOVER_TIMEOUT
    ) -> Any:
        """Listen, publish the sealed address, send to the first peer holding the seal; the stats."""
        from torchpass_slurm.transfer import SocketListener, send_state

        host = _reachable_host(self.store_addr, self.store_port)
        with SocketListener(host, 0) as listener:
            address = f"{host}:{listener.port}"
            _base, store = _epoch_store(
                self.open_store, self.store_addr, self.store_port, self.epoch, timeout
            )
            store.set(DONOR_KEY.format(rank=self.rank), f"{address}:{self.seal.tag(address)}")
            transport = listener.accept_sealed(self.seal, timeout)
        try:
            return send_state(transport, state, timeout=TRANSFER_TIMEOUT, meta=meta, seal=self.seal)
        finally:
            transport.close()


def connect_to_leaving(
    rt: Runtime, rank: int, seal: Seal | None, timeout: datetime.timedelta = PLANNED_HANDOVER_TIMEOUT
) -> Any:
    """The transport to the leaving rank ``rank``, found in this epoch's store; TransferError
    when it did not publish itself in time or its address was not sealed with ``seal``."""
    from torchpass_slurm.transfer import SocketTransport

    info = rt.info
    if info is None or not info.store_addr or not info.store_port or seal is None:
        raise TransferError(
            f"rank {rank} leaves by a drain but this rank has no rendezvous store or job secret",
            hint="planned migrations run under tp run, which hosts the store and gives the secret",
        )
    _base, store = _epoch_store(rt.job_store, info.store_addr, int(info.store_port), rt.epoch, timeout)
    key = DONOR_KEY.format(rank=rank)
    try:
        store.wait([key], timeout)
        host, port, tag = store.get(key).decode("utf-8", errors="replace").rsplit(":", 2)
        port_number = int(port)
    except (RuntimeError, ValueError) as exc:  # DistStoreError is a RuntimeError
        raise TransferError(
            f"the leaving rank {rank} did not publish its address under epoch{rt.epoch}/{key} "
            f"within {timeout}: {str(exc)[:200]}",
            hint="did the drained rank reach the switch step?",
        ) from exc
    if not seal.check_tag(f"{host}:{port}", tag):
        rt.log.warning("refused the address under epoch%d/%s: not sealed with the job's key", rt.epoch, key)
        raise TransferError(
            f"the address published for the leaving rank {rank} under epoch{rt.epoch}/{key} does not "
            "carry the job's seal: someone without the job's key wrote it",
            hint="the rendezvous store was written by an outsider; the handover is refused",
        )
    return SocketTransport.connect_sealed(host, port_number, seal, timeout)
