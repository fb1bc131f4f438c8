"""The rank side of live migration: a training loop that survives a lost peer.

:class:`ElasticTrainer` runs the user's step function and owns the three
things live migration needs to control: the process group, the DDP wrapper
and the commit of each step::

    trainer = ElasticTrainer(rt, model, optimizer, state={"train": TrainState(model, opt)})
    trainer.fit(train_step, steps=1000, on_commit=log_and_checkpoint)

``train_step(step, ddp_model)`` does the forward and the backward pass (DDP
all-reduces the gradients inside ``backward``) and returns the loss. The
trainer then applies the step with ``optimizer.step()``. That is the commit
rule: a step counts once this rank has its reduced gradients; a failure
before that point discards the step (nothing was applied, the gradients are
dropped), a failure after it (in ``on_commit``: logging, checkpoints) leaves
the step committed.

When a collective fails (a peer died) the rank reports ``collective_failed``
to the supervisor and waits for ``reconfigure``: the new epoch, in which a
spare holds the lost logical rank. Then, in the same process::

    rejoin      destroy the broken group, build the epoch's group (same world, same ranks)
    agree       all-gather every rank's committed step; S = the highest
    transfer    each rank behind S (the promoted spare, rarely a survivor) receives the
                full state from a rank at S (a data-parallel replica), chunked and verified
    rewrap      a fresh DDP on the new group; the loop goes on at step S

A promoted spare enters the same path from :meth:`ElasticTrainer.fit` with
step -1. Per-rank randomness must be a function of (seed, rank, step): the
lost rank's RNG state died with it, and the spare derives it again.

State that belongs to one rank (a data loader's position) goes in ``rank_state``:
each step's copy goes to the supervisor when the step's collectives start, and
after every agreement on step S each rank holds its rank state of S
(:mod:`.rankstate`; a promoted spare gets the lost rank's copies with its promotion).
"""

from __future__ import annotations

import datetime
import logging
import re
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from torchpass_slurm.control.bodies import PromoteMode, Reconfigure
from torchpass_slurm.control.messages import ReportKind
from torchpass_slurm.errors import CollectiveError, TransferError
from torchpass_slurm.phase import Phase
from torchpass_slurm.rank.group import destroy_group, release_kept, stacks_if_slow, tearing_down
from torchpass_slurm.rank.handover import Handover
from torchpass_slurm.rank.rankstate import RANK_STATE_KEY, RankState
from torchpass_slurm.rank.runtime import Runtime

if TYPE_CHECKING:
    import torch
    from torch import nn

logger = logging.getLogger(__name__)

#: How long a rank whose collective failed waits for the supervisor's reconfigure, besides the
#: time the supervisor may hold the job for a spare (:func:`reconfigure_timeout`).
RECONFIGURE_TIMEOUT = datetime.timedelta(seconds=120)
#: A teardown slower than this writes every thread's stack to the rank's stderr (seconds).
TEARDOWN_STACKS_S = 3.0
#: A broken group is kept this long past the collective timeout before it is let go
#: (``rank/group.py``: its destructor must not wait for work in flight).
KEEP_BROKEN_MARGIN_S = 5.0
#: How long building an epoch's group waits for every rank to join.
RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=120)

#: The keyword arguments of every DDP wrap (the first, and the fresh one after each migration);
#: ``ElasticTrainer(ddp_kwargs=...)`` overrides them key by key. ``find_unused_parameters=True``
#: is here for bitwise determinism, not for unused parameters: it is the one setting under which
#: DDP never rebuilds its buckets. Without it DDP puts every parameter in one bucket for a wrap's
#: first step and rebuilds the buckets in gradient-ready order before the second, so the first
#: step after a re-wrap (or a resume) reduces on another layout than the same step of a run never
#: re-wrapped, and gloo sums an element in an order set by its place in the bucket. Measured with
#: ``python -m benchmarks.ddp_determinism`` (torch 2.13 CPU, gloo, 3 processes, tiny_gpt d_model
#: 128, 2 layers, AdamW, 30 steps): with the defaults, ``static_graph=True``,
#: ``bucket_cap_mb=1024`` or ``gradient_as_bucket_view=True``, both a run re-wrapped before steps
#: 10 and 20 and fresh processes resuming at step 10 first differ at step 10 and end with ~380,000
#: of 466,432 parameters different; with ``find_unused_parameters=True`` all three runs end
#: bitwise equal. So does one parameter per bucket (``bucket_cap_mb_list=[1e-6]``, a torch 2.13
#: keyword that Debian's torch 2.6 lacks), at 1.3 to 2.3 times the step time. The extra
#: autograd-graph traversal of ``find_unused_parameters=True`` did not show above the noise of a
#: shared 2-core host: 3 runs measured the defaults -11 %, -29 % and +9 % against it.
DEFAULT_DDP_KWARGS: Mapping[str, Any] = MappingProxyType({"find_unused_parameters": True})

#: How torch.distributed's C++ layer words the plain RuntimeError it raises for a failed
#: collective: the throw site first (``[.../gloo/transport/tcp/pair.cc:537] Read error ...``), the
#: c10d rank prefix (``[Rank 0]: Ranks 2 failed to pass monitoredBarrier ...``), NCCL by name, or
#: gloo closing a pair whose peer went silent past the collective timeout (``Application timeout
#: caused pair closure``, with no throw site). Measured: torch 2.13's gloo raises plain
#: RuntimeError with the throw site for a dead or a hung peer; Debian's torch 2.6 the pair closure
#: when a survivor waits on a powered-off node. DistError covers the store and NCCL's own errors.
#: A rank that reached gloo's monitored barrier while rank 0 died says so ("Rank 2 successfully
#: reached monitoredBarrier, but received errors while waiting for send/recv from rank 0 ...
#: Original exception:" and the throw site on a line of its own): the throw site may start any
#: line, and both of monitoredBarrier's own failures name it.
_TORCH_COMM_ERROR = re.compile(
    r"^\[(?:[^\]]*\.(?:cc|cpp|h):\d+|Rank \d+)\]|\bNCCL\b|\bpair closure\b"
    r"|^Rank \d+ successfully reached monitoredBarrier, but received errors",
    re.MULTILINE,
)


def is_comm_error(exc: BaseException) -> bool:
    """True when ``exc`` is a failed collective (a peer died), not a bug of the training.

    Decided by type: the project's own :class:`~torchpass_slurm.errors.CollectiveError`
    (a rendezvous that timed out) and :class:`~torchpass_slurm.errors.TransferError`,
    torch's ``DistError`` family, and a plain ``RuntimeError`` only when it comes from
    torch.distributed's C++ layer (:data:`_TORCH_COMM_ERROR`), never for words in a
    user's message such as "timeout" or "connection". An error raised *from* one of
    these (``raise ... from exc``: a ``CheckpointError`` whose save lost a peer inside its
    gather) is one too; an error merely raised while handling one is not.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if _is_comm_error_itself(current):
            return True
        seen.add(id(current))
        current = current.__cause__
    return False


def _is_comm_error_itself(exc: BaseException) -> bool:
    if isinstance(exc, (CollectiveError, TransferError)):
        return True
    try:
        import torch.distributed as dist

        if isinstance(exc, getattr(dist, "DistError", ())):
            return True
    except ImportError:  # pragma: no cover - torch is there whenever this runs
        pass
    return type(exc) is RuntimeError and _TORCH_COMM_ERROR.search(str(exc)) is not None


def leave_if_fenced(rt: Runtime, step: int) -> None:
    """The supervisor told this rank to stop (its step was declared lost while it lived on:
    a healed partition, a frozen process that woke up): it must not train on, nor wait for
    an epoch it is no longer part of. Exits the process (status 1, with the reason)."""
    if rt.stop_requested.is_set():
        rt.log.error("fenced by the supervisor: leaving at step %d", step)
        raise SystemExit(f"torchpass: this rank was fenced by the supervisor at step {step}")


def collective_timeout() -> datetime.timedelta:
    """Timeout of one collective: ``TORCHPASS_COLLECTIVE_TIMEOUT`` (see config)."""
    from torchpass_slurm import config

    return datetime.timedelta(
        seconds=config.env_float(
            config.ENV_COLLECTIVE_TIMEOUT, config.DEFAULT_COLLECTIVE_TIMEOUT_S, minimum=1.0
        )
    )


def reconfigure_timeout() -> datetime.timedelta:
    """How long a rank whose collective failed waits for its reconfigure: :data:`RECONFIGURE_TIMEOUT`
    plus ``TORCHPASS_SPARE_WAIT``, for which the supervisor may hold the job when no spare is
    left (``supervisor/hold.py``)."""
    from torchpass_slurm.config import SupervisorConfig

    return RECONFIGURE_TIMEOUT + datetime.timedelta(seconds=SupervisorConfig.from_env().spare_wait)


class ElasticTrainer:
    """A data-parallel training loop that carries on through a lost rank; see the module doc.

    ``ddp_kwargs`` override :data:`DEFAULT_DDP_KWARGS` key by key; that constant's comment says
    why it keeps ``find_unused_parameters=True`` (bitwise equality across a re-wrap).
    """

    def __init__(
        self,
        rt: Runtime,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        state: Mapping[str, Any],
        scheduler: Any = None,
        backend: str = "gloo",
        ddp_kwargs: Mapping[str, Any] | None = None,
        start_step: int = 0,
        rank_state: Mapping[str, Any] | None = None,
    ) -> None:
        self.rt = rt
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.state = dict(state)
        self.handover = Handover(rt, self.state)
        self.backend = backend
        self.ddp_kwargs = {**DEFAULT_DDP_KWARGS, **(ddp_kwargs or {})}
        self.step = start_step
        self.ddp_model: nn.Module = model
        self.migrations = 0
        self._first_step_pending = False
        #: True once this rank left the job (its node was drained); the loop ends
        self.released = False
        self._started = False
        self._pending: list[Reconfigure] = []
        #: what belongs to this rank alone (its data loader position); None: nothing, no cost
        self.rank_state = RankState(rt, rank_state) if rank_state else None

    @property
    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint of this rank holds: ``state``, and the rank state beside it (save this)."""
        if self.rank_state is None:
            return self.state
        return {**self.state, RANK_STATE_KEY: self.rank_state.checkpoint_entry()}

    @property
    def received_state(self) -> bool:
        """True once this rank received the training state from a replica."""
        return self.handover.received

    # -- the loop ------------------------------------------------------------
    def start(self) -> None:
        """Join the group; a spare promoted live receives the state first. Idempotent."""
        if self._started:
            return
        self._started = True
        if self.rt.world_size > 1 or (self.rt.info and self.rt.info.store_addr):
            self.rt.init_process_group(self.backend, collective_timeout(), RENDEZVOUS_TIMEOUT)
        self.rt.report(ReportKind.LIVE_READY, step=self.step, epoch=self.rt.epoch, **self._get_ready())
        promotion = self.rt.promotion
        if self.rt.is_spare_promoted and promotion is not None and promotion.mode == PromoteMode.LIVE:
            self.step = -1
            self._first_step_pending = True
            try:
                self._receive_live()
                self._restore_rank_state(self.step)  # the lost rank's own, from the promotion
            except Exception as exc:  # judged below: the donor died mid-transfer, or a bug
                self._recover_or_raise(exc)
                return
        elif self.rank_state is not None:
            self.rank_state.capture(self.step)
        self._wrap()

    def _get_ready(self) -> dict[str, Any]:
        """What :meth:`start` does in the group before it says ``live_ready``, and what that
        report says besides the step (nothing here; a sharded trainer builds its mesh)."""
        return {}

    def _receive_live(self) -> None:
        """A spare promoted live joins the first agreement and receives the state."""
        self._sync_state()

    def resume_from_checkpoint(self, directory: Any) -> int:
        """Load the newest checkpoint unless the state came live from a replica; the step."""
        from torchpass_slurm.rank import checkpoint

        if self.received_state or directory is None:
            return self.step
        self.step = checkpoint.load_latest(self.checkpoint_state, directory) or 0
        if self.rank_state is not None:
            self.rank_state.capture(self.step)
        if self.rt.rank == 0:
            self.rt.report(ReportKind.RESUMED, step=self.step, epoch=self.rt.epoch)
        return self.step

    def close(self) -> None:
        """Leave the group together with the others (rank 0 may host the rendezvous)."""
        import torch.distributed as dist

        if dist.is_initialized() and not self.released:
            dist.barrier()
            destroy_group(self.rt.log)

    def fit(
        self,
        train_step: Callable[[int, nn.Module], torch.Tensor],
        steps: int,
        on_commit: Callable[[int, torch.Tensor], None] | None = None,
    ) -> torch.Tensor | None:
        """Run ``train_step`` for every step up to ``steps``; return the last loss."""
        self.start()
        loss = None
        while self.step < steps and not self.released:
            leave_if_fenced(self.rt, self.step)
            self.optimizer.zero_grad(set_to_none=True)
            self.rt.state = Phase.COMPUTE  # SYNC once the DDP model's forward is called (_wrap)
            try:
                loss = train_step(self.step, self.ddp_model)
            except Exception as exc:  # judged at the step boundary: a failed collective, or a bug
                self._recover_or_raise(exc)
                continue
            self._commit()
            if on_commit is not None:
                self.rt.state = Phase.HOOK
                try:
                    on_commit(self.step, loss)
                except Exception as exc:  # judged the same way; the step stays committed
                    self._recover_or_raise(exc)
                    continue
            switch = self._planned_switch_due()
            if switch is not None:
                self._reconfigure(switch)
        if not self.released:
            self._switch_at_the_end()
        self.rt.state = Phase.RUNNING
        return loss

    def _switch_at_the_end(self) -> None:
        """A drain announced too close to the end for its switch step (past the last step)
        switches once the last step is committed: the spare holds the rank when the job ends,
        and the drained node leaves live instead of the spare waiting for a group that never
        forms (its recovery stalls into a restart)."""
        self._collect_reconfigures()
        switch = self._take_pending(lambda b: b.planned)
        if switch is not None:
            self.rt.log.info(
                "the switch after step %s is past the last step: switching now", switch.switch_after
            )
            self._reconfigure(switch)

    def _planned_switch_due(self) -> Reconfigure | None:
        """A planned migration whose switch step this rank has committed, if any.

        The supervisor announces a drain as "switch after step S", S far enough
        ahead that every rank hears of it first, so no collective is needed to
        agree on it. A rank that heard too late finds its next collective
        failing (the others left the group) and joins the new epoch through
        the recovery path, at the step it committed last; the agreement there
        takes the highest step anyway.
        """
        self._collect_reconfigures()
        return self._take_pending(
            lambda b: b.planned and (b.switch_after is None or self.step >= b.switch_after)
        )

    def _take_pending(self, wanted: Callable[[Reconfigure], bool]) -> Reconfigure | None:
        """The oldest pending reconfigure of a newer epoch that is ``wanted`` (taken, older dropped)."""
        for body in sorted(self._pending, key=lambda b: b.epoch):
            if body.epoch > self.rt.epoch and wanted(body):
                self._pending = [b for b in self._pending if b.epoch > body.epoch]
                return body
        return None

    def _collect_reconfigures(self) -> None:
        while True:
            body = self.rt.wait_reconfigure(datetime.timedelta(0))
            if body is None:
                return
            self._pending.append(body)

    def _next_reconfigure(self, timeout: datetime.timedelta) -> Reconfigure | None:
        """The pending or next reconfigure for a newer epoch."""
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            self._collect_reconfigures()
            body = self._take_pending(lambda b: True)
            if body is not None:
                return body
            leave_if_fenced(self.rt, self.step)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            got = self.rt.wait_reconfigure(datetime.timedelta(seconds=min(left, 0.5)))
            if got is not None:
                self._pending.append(got)

    def _commit(self) -> None:
        release_kept()  # broken groups whose work has timed out: their destructors return at once
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.step += 1
        self.rt.report_step(self.step)
        if self.rank_state is not None and self.rank_state.tag != self.step:
            self.rank_state.capture(self.step)  # no forward pre-hook ran (one rank, or a custom wrap)
        if self._first_step_pending and self.rt.rank == 0:
            self.rt.report(ReportKind.FIRST_STEP, step=self.step, epoch=self.rt.epoch)
        self._first_step_pending = False

    # -- recovery ------------------------------------------------------------
    def _recover_or_raise(self, exc: Exception) -> None:
        if not is_comm_error(exc) or self.rt.role.value == "plain":
            raise exc  # a bug, or no supervisor to reconfigure the group (plain srun/torchrun)
        self.rt.state = Phase.RECOVERING
        self.rt.log.warning("collective failed at step %d: %s", self.step, str(exc)[:200])
        if self.rank_state is not None:  # the step's batch may be drawn without a copy taken
            self.rank_state.forget_held()
        self._tear_down(exc)
        while True:
            body = self._next_reconfigure(reconfigure_timeout())
            if body is None:
                self.rt.log.error("no reconfigure from the supervisor within %s", reconfigure_timeout())
                raise exc
            try:
                self._reconfigure(body)
                return
            except Exception as again:  # a second failure during recovery: wait for the next epoch
                if not is_comm_error(again):
                    raise
                self.rt.log.warning("recovery of epoch %s failed: %s", body.epoch, again)
                self._tear_down(again)

    def _tear_down(self, exc: Exception) -> None:
        """Report the failed collective, then close the broken group's sockets, so no peer waits
        on this rank until its timeout, and drop the group (``rank/group.py``,
        :func:`tearing_down`). The report goes first: the supervisor hears at once that this rank
        is alive and recovering, however long the teardown takes. The group is never reused:
        :meth:`Runtime.rejoin` builds the next epoch's."""
        with stacks_if_slow(TEARDOWN_STACKS_S, self.rt.log):
            self.rt.report(
                ReportKind.COLLECTIVE_FAILED, step=self.step, error=str(exc)[:200], epoch=self.rt.epoch
            )
            keep_for = collective_timeout().total_seconds() + KEEP_BROKEN_MARGIN_S
            with tearing_down(exc, self.rt.log, keep_for=keep_for):
                self.ddp_model = self.model  # the DDP wrapper holds the group

    def _reconfigure(self, body: Reconfigure) -> None:
        self.rt.state = Phase.RECOVERING
        if self.rt.rank in body.leave:
            self._release(body)
            return
        started = time.monotonic()
        self.rt.rejoin(body, self.backend, collective_timeout(), RENDEZVOUS_TIMEOUT)
        self.rt.report(
            ReportKind.GROUP_REBUILT, seconds=round(time.monotonic() - started, 4), epoch=self.rt.epoch
        )
        self._sync_state()
        self._restore_rank_state(self.step)
        self._wrap()
        self.migrations += 1
        self._first_step_pending = True

    def _release(self, body: Reconfigure) -> None:
        """This rank's node is drained: hand over (a replica sends the state) and leave."""
        destroy_group(self.rt.log)
        self.released = True
        self.rt.report(ReportKind.RELEASED, step=self.step, epoch=body.epoch)
        self.rt.log.info("released at step %d: this node is being drained", self.step)

    def _sync_state(self) -> None:
        """Agree on the committed step; ranks behind it receive the state from a replica."""
        self.step = self.handover.sync(self.step)

    def _restore_rank_state(self, step: int) -> None:
        """After the agreement on ``step``: this rank's own state is the one of that step (its own
        copy, or a promoted spare's copy of the lost rank's); RankStateError if there is none."""
        if self.rank_state is not None:
            promotion = self.rt.promotion if self.rt.is_spare_promoted else None
            self.rank_state.restore(step, promotion.rank_state if promotion is not None else ())

    def _wrap(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.ddp_model = DDP(self.model, **self.ddp_kwargs)
            self.ddp_model.register_forward_pre_hook(self._forward_called)
        else:
            self.ddp_model = self.model

    def _forward_called(self, *_: object) -> None:
        """The DDP model's forward is called: its collectives start here (a buffer broadcast,
        then the backward's all-reduce). The hang detector tells a rank stuck before them from
        peers waiting in them (``torchpass_slurm.phase``). The batch of this step is drawn: the
        rank state is the one valid once it commits, and its copy leaves before the all-reduce."""
        self.rt.state = Phase.SYNC
        if self.rank_state is not None:
            self.rank_state.capture(self.step + 1)
