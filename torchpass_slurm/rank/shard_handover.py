"""The handover of a sharded job: agree on the step, then move only the lost rank's shards.

:meth:`ShardHandover.sync` is the "agree" and "transfer" of a sharded rank's recovery
(``rank/sharded.py``), after every rank rebuilt its model on the new epoch's mesh::

    agree       all-gather (committed step, the ranks leaving by a planned drain);
                S = the highest step
    plan        each rank behind S (a promoted spare: step -1) gets one donor:
                  the rank leaving its logical rank, when a drain announced it (pure FSDP too)
                  else a replica at S holding the same shard coordinate
                  (assign_donors: spread over replica groups, rank 0 only as the last choice)
                  else nobody: NoReplicaError on every rank (restart from a checkpoint)
    transfer    the donor streams ITS OWN local shards (parameters and optimizer state) with
                their shard metadata in the manifest's meta; the receiver checks the mesh, the
                donor's coordinate and every tensor's global shape, stride, placements and
                local shape against its own fresh model before one byte is written
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
from a rank of this job are refused before they become training state.
"""

from __future__ import annotations

import datetime
import logging
import socket
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torchpass_slurm.control.messages import ReportKind
from torchpass_slurm.errors import NoReplicaError, TransferError
from torchpass_slurm.mesh import MeshLayout, assign_donors
from torchpass_slurm.rank.handover import TRANSFER_TIMEOUT, report_transfer
from torchpass_slurm.rank.runtime import Runtime
from torchpass_slurm.rank.shard_state import check_specs, load_local_state, local_state

if TYPE_CHECKING:
    import torch
    from torch import nn

    from torchpass_slurm.transfer import Manifest, Transport
    from torchpass_slurm.transfer.seal import Seal

__all__ = ["ShardHandover", "LeavingDonor", "Agreement", "plan_shard_donors", "PLANNED_HANDOVER_TIMEOUT"]

logger = logging.getLogger(__name__)

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


def plan_shard_donors(
    layout: MeshLayout, agreement: Agreement, avoid: Collection[int] = (0,)
) -> dict[int, int]:
    """Receiver -> donor rank. A receiver whose rank is leaving gets the leaving rank itself
    (the same number: the process outside the group); the others a replica at the agreed
    step. A receiver left out has no donor. Pure: every rank computes the same plan."""
    plan = {r: r for r in agreement.receivers if r in agreement.leaving}
    rest = [r for r in agreement.receivers if r not in plan]
    plan.update(assign_donors(layout, rest, agreement.holders, avoid=avoid))
    return plan


def shard_meta(layout: MeshLayout, rank: int, step: int, specs: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest's ``meta`` of a shard transfer: the step and what the shards are."""
    return {
        "step": step,
        "shards": {
            "mesh": layout.to_json(),
            "rank": rank,
            "coord": list(layout.coord(rank)),
            "specs": dict(specs),
        },
    }


def judge_shard_manifest(
    manifest: Manifest, layout: MeshLayout, rank: int, donor: int, step: int, model: nn.Module
) -> None:
    """Raise TransferError unless ``manifest`` holds ``donor``'s shards of step ``step`` and
    they are the shards of this rank's coordinate on this rank's mesh and model."""
    meta = manifest.meta if isinstance(manifest.meta, dict) else {}
    shards = meta.get("shards")
    if not isinstance(shards, dict):
        raise TransferError(
            f"the state from rank {donor} carries no shard metadata; this rank is sharded",
            hint="donor and receiver must both run ShardedTrainer of the same torchpass-slurm version",
        )
    if meta.get("step") != step:
        raise TransferError(
            f"rank {donor} sent the state of step {meta.get('step')!r}; the agreed step is {step}"
        )
    if shards.get("mesh") != layout.to_json():
        raise TransferError(
            f"rank {donor} sent shards of the mesh {shards.get('mesh')!r}; "
            f"this rank's mesh is {layout.to_json()}",
            hint="every rank of the job must build the same mesh layout",
        )
    coord = shards.get("coord")
    if shards.get("rank") != donor or coord != list(layout.coord(donor)):
        raise TransferError(
            f"the shards sent as rank {donor}'s say rank {shards.get('rank')!r} at {coord!r}; "
            f"rank {donor} sits at {list(layout.coord(donor))} of {list(layout.shape)}"
        )
    if layout.shard_coord(donor) != layout.shard_coord(rank):
        raise TransferError(
            f"rank {donor} at {coord} holds another shard than rank {rank} at {list(layout.coord(rank))}",
            hint="a donor must hold the same shard coordinate in another replica group",
        )
    specs = shards.get("specs")
    if not isinstance(specs, dict):
        raise TransferError(f"the shard metadata from rank {donor} has no tensor specs")
    check_specs(specs, {e.path: e.shape for e in manifest.entries}, model, f"the state from rank {donor}")


class ShardHandover:
    """Agreement and shard transfer for one rank of a sharded job laid out as ``layout``."""

    def __init__(self, rt: Runtime, layout: MeshLayout) -> None:
        self.rt = rt
        self.layout = layout
        #: True once this rank received its shards from a donor
        self.received = False
        #: bytes this rank received in its last transfer (the lost rank's shard, not the model)
        self.received_bytes = 0

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

    def sync(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, leaving: Collection[int]
    ) -> int:
        """Agree; ranks behind the agreed step receive their shards. The agreed step."""
        import torch.distributed as dist

        agreement = self.agree(step, leaving)
        plan = plan_shard_donors(self.layout, agreement)
        if self.rt.rank == 0:
            self.rt.report(
                ReportKind.AGREEMENT,
                committed_step=agreement.committed,
                receivers=agreement.receivers,
                donors=sorted(set(plan.values())),
                leaving=sorted(agreement.leaving),
                epoch=self.rt.epoch,
            )
        lost = [r for r in agreement.receivers if r not in plan]
        if lost:
            raise NoReplicaError(
                f"no replica holds the shards of rank(s) {lost} at step {agreement.committed} "
                f"(mesh {dict(zip(self.layout.dims, self.layout.shape, strict=True))}, "
                f"replicate dimension {self.layout.replicate!r}): they cannot be moved live",
                hint="restart the job from its newest checkpoint with the same mesh",
            )
        for recv, donor in sorted(plan.items()):
            if self.rt.rank == recv:
                self._receive(donor, agreement.committed, model, optimizer, leaving=recv in agreement.leaving)
            elif self.rt.rank == donor and recv not in agreement.leaving:
                self._send(recv, agreement.committed, model, optimizer)
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=TRANSFER_TIMEOUT)
        else:  # monitored_barrier is gloo-only; the group's collective timeout applies
            dist.barrier()
        return agreement.committed

    def _send(self, receiver: int, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        from torchpass_slurm.transfer import TorchTransport, send_state

        state, specs = local_state(model, optimizer)
        meta = shard_meta(self.layout, self.rt.rank, step, specs)
        seal = self.rt.transfer_seal(self.rt.epoch, step, self.rt.rank, receiver)
        stats = send_state(TorchTransport(receiver), state, timeout=TRANSFER_TIMEOUT, meta=meta, seal=seal)
        self.rt.log.info("sent my shards of step %d to rank %d: %s", step, receiver, stats)

    def _receive(
        self, donor: int, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, *, leaving: bool
    ) -> None:
        from torchpass_slurm.transfer import TorchTransport, recv_state

        into, _ = local_state(model, optimizer)  # this rank's own shards: filled in place

        def accept(manifest: Manifest) -> None:
            judge_shard_manifest(manifest, self.layout, self.rt.rank, donor, step, model)

        seal = self.rt.transfer_seal(self.rt.epoch, step, donor, self.rt.rank)
        if leaving:
            transport: Transport = connect_to_leaving(self.rt, donor, seal)
        else:
            transport = TorchTransport(donor)
        try:
            received, stats = recv_state(
                transport, timeout=TRANSFER_TIMEOUT, into=into, accept=accept, seal=seal
            )
        finally:
            if leaving:
                transport.close()
        load_local_state(model, optimizer, received)
        self.received = True
        self.received_bytes = stats.bytes
        via = "socket" if leaving else "group"
        report_transfer(self.rt, donor, step, stats, sealed=seal is not None, via=via)


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
