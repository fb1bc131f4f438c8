"""The handover after a new epoch's group is up: agree on the committed step, move the state.

:meth:`Handover.sync` is the "agree" and "transfer" of the recovery path
(``rank/elastic.py``)::

    agree       all-gather every rank's committed step; S = the highest
    transfer    each rank behind S (the promoted spare, rarely a survivor) receives the
                full state from a rank at S (a data-parallel replica), chunked and sealed
                with the job's key (``transfer/seal.py``);
                receiver i takes donor i % len(donors), in rank order
    barrier     every rank waits for the transfers (a monitored barrier on gloo)

A receiver's progress survives a donor's death: the next epoch's transfer
resumes from the chunks already verified (``transfer.ReceiveProgress``).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torchpass_slurm.control.messages import ReportKind
from torchpass_slurm.rank.runtime import Runtime

if TYPE_CHECKING:
    from torchpass_slurm.transfer import TransferStats

__all__ = ["Handover", "TRANSFER_TIMEOUT", "report_transfer"]

#: Timeout of one state transfer call.
TRANSFER_TIMEOUT = datetime.timedelta(seconds=120)


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
    """Agreement and state transfer for one rank whose state is ``state`` (name -> Stateful)."""

    def __init__(self, rt: Runtime, state: Mapping[str, Any]) -> None:
        self.rt = rt
        self.state = dict(state)
        #: True once this rank received the training state from a replica
        self.received = False
        self._progress: Any = None  # transfer progress, kept across a donor's death

    def sync(self, step: int) -> int:
        """Agree on the committed step; ranks behind it receive the state. The agreed step."""
        import torch
        import torch.distributed as dist

        world = dist.get_world_size()
        mine = torch.tensor([step], dtype=torch.int64)
        steps = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(steps, mine)
        held = [int(t.item()) for t in steps]
        committed = max(held)
        donors = [r for r, s in enumerate(held) if s == committed]
        receivers = [r for r, s in enumerate(held) if s < committed]
        if self.rt.rank == 0:
            self.rt.report(
                ReportKind.AGREEMENT,
                committed_step=committed,
                receivers=receivers,
                donors=donors,
                epoch=self.rt.epoch,
            )
        plan = {recv: donors[i % len(donors)] for i, recv in enumerate(receivers)}
        for recv, donor in plan.items():
            if self.rt.rank == donor:
                self._send(recv, committed)
            elif self.rt.rank == recv:
                self._receive(donor, committed)
        # Ranks outside the transfer wait here for as long as a transfer may take,
        # not just one collective's timeout.
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=TRANSFER_TIMEOUT)
        else:  # monitored_barrier is gloo-only; the group's collective timeout applies
            dist.barrier()
        return committed

    def _state_dicts(self) -> dict[str, Any]:
        return {name: obj.state_dict() for name, obj in self.state.items()}

    def _send(self, receiver: int, step: int) -> None:
        from torchpass_slurm.transfer import TorchTransport, send_state

        stats = send_state(
            TorchTransport(receiver),
            self._state_dicts(),
            timeout=TRANSFER_TIMEOUT,
            meta={"step": step},
            seal=self.rt.transfer_seal(self.rt.epoch, step, self.rt.rank, receiver),
        )
        self.rt.log.info("sent the state of step %d to rank %d: %s", step, receiver, stats)

    def _receive(self, donor: int, step: int) -> None:
        from torchpass_slurm.transfer import ReceiveProgress, TorchTransport, recv_state

        if self._progress is None:
            self._progress = ReceiveProgress()
        seal = self.rt.transfer_seal(self.rt.epoch, step, donor, self.rt.rank)
        received, stats = recv_state(
            TorchTransport(donor),
            timeout=TRANSFER_TIMEOUT,
            into=self._state_dicts(),
            progress=self._progress,
            seal=seal,
        )
        for name, obj in self.state.items():
            obj.load_state_dict(received[name])
        self._progress = None
        self.received = True
        report_transfer(self.rt, donor, step, stats, sealed=seal is not None)
