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
    renew       the training state onto the new group (DDP: nothing; sharded: the mesh and
                the model built again, this rank's own shards kept)
    agree       all-gather every rank's committed step; S = the highest
    transfer    each rank behind S (the promoted spare, rarely a survivor) receives the
                state from a rank at S (a replica; in a sharded drain, the leaving rank),
                chunked and verified (``rank/handover.py``)
    rewrap      a fresh DDP on the new group (FSDP2 wraps in build); the loop goes on at step S

One loop for every layout: what a rank's state is, how it is built, sent, judged and
loaded is the injected :class:`~torchpass_slurm.rank.training_state.TrainingState`, full
state_dicts for DDP (``rank/replicated.py``, this constructor's) or local shards for
FSDP2/HSDP (``rank/sharded.py``, ``ShardedTrainer``).

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
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchpass_slurm.control.bodies import PromoteMode, Reconfigure
from torchpass_slurm.control.messages import ReportKind
from torchpass_slurm.errors import CollectiveError, TransferError
from torchpass_slurm.phase import Phase
from torchpass_slurm.rank.backends import AUTO, choose_backend, group_backend, training_device
from torchpass_slurm.rank.group import destroy_group, release_kept, stacks_if_slow
from torchpass_slurm.rank.handover import Handover
from torchpass_slurm.rank.rankstate import RankState
from torchpass_slurm.rank.reconfigures import PendingReconfigures, leave_if_fenced
from torchpass_slurm.rank.replicated import DEFAULT_DDP_KWARGS, ReplicatedState, with_rank_state
from torchpass_slurm.rank.runtime import Runtime

if TYPE_CHECKING:
    import torch
    from torch import nn

    from torchpass_slurm.rank.training_state import TrainingState

__all__ = ["ElasticTrainer", "is_comm_error", "DEFAULT_DDP_KWARGS", "collective_timeout", "leave_if_fenced"]

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
    """A training loop that carries on through a lost rank, for every layout; see the module doc.

    What differs between DDP and a sharded model is the injected ``TrainingState``
    (``rank/training_state.py``). This constructor is DDP's; :meth:`with_training_state` takes
    any (``ShardedTrainer``). ``ddp_kwargs`` override :data:`DEFAULT_DDP_KWARGS` key by key.
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
        training = ReplicatedState(model, optimizer, state, ddp_kwargs)
        self._setup(rt, training, scheduler, backend, start_step, rank_state)
        self.ddp_kwargs = training.ddp_kwargs

    @classmethod
    def with_training_state(
        cls,
        rt: Runtime,
        training: TrainingState,
        *,
        scheduler: Any = None,
        backend: str = "gloo",
        start_step: int = 0,
        rank_state: Mapping[str, Any] | None = None,
    ) -> ElasticTrainer:
        """The trainer of ``training``, a state of any layout (``rank/training_state.py``)."""
        trainer = cls.__new__(cls)
        trainer._setup(rt, training, scheduler, backend, start_step, rank_state)
        return trainer

    def _setup(
        self,
        rt: Runtime,
        training: TrainingState,
        scheduler: Any,
        backend: str,
        start_step: int,
        rank_state: Mapping[str, Any] | None,
    ) -> None:
        self.rt = rt
        self.training = training
        self.scheduler = scheduler
        self.handover = Handover(rt, training)
        self.backend = choose_backend(backend, training_device(training)) if backend == AUTO else backend
        self.ddp_kwargs = dict[str, Any]()  # the keyword arguments of every DDP wrap (DDP's alone)
        self.step = start_step
        self._wrapped: nn.Module | None = None  # the module train_step is given, if not the model
        self.migrations = 0
        self._first_step_pending = False
        #: True once this rank left the job (its node was drained); the loop ends
        self.released = False
        self._started = False
        self.reconfigures = PendingReconfigures(rt)
        #: what belongs to this rank alone (its data loader position); None: nothing, no cost
        self.rank_state = RankState(rt, rank_state) if rank_state else None

    @property
    def model(self) -> nn.Module:  # a sharded one is built at start() and again at every epoch
        return self.training.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.training.optimizer

    @property
    def state(self) -> dict[str, Any]:
        return self.training.state

    @property
    def ddp_model(self) -> nn.Module:
        """The module ``train_step`` is given: the epoch's DDP wrapper, or the model itself."""
        return self._wrapped if self._wrapped is not None else self.training.model

    @ddp_model.setter
    def ddp_model(self, module: nn.Module | None) -> None:
        self._wrapped = module

    @property
    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint of this rank holds: ``state``, and the rank state beside it (save this)."""
        return with_rank_state(self.training.state, self.rank_state)

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
        self.rt.report(ReportKind.LIVE_READY, step=self.step, epoch=self.rt.epoch, **self.training.ready())
        promotion = self.rt.promotion
        if self.rt.is_spare_promoted and promotion is not None and promotion.mode == PromoteMode.LIVE:
            self.step = -1
            self._first_step_pending = True
            try:
                self.step = self.handover.sync(self.step)  # built in ready(): nothing to renew
                self._restore_rank_state(self.step)  # the lost rank's own, from the promotion
            except Exception as exc:  # judged below: the donor died mid-transfer, or a bug
                self._recover_or_raise(exc)
                return
        elif self.rank_state is not None:
            self.rank_state.capture(self.step)
        self._wrap()

    def resume_from_checkpoint(self, directory: Any) -> int:
        """Load the newest checkpoint unless the state came live from a donor; the step."""
        if self.received_state or directory is None:
            return self.step
        self.step = self.training.load_checkpoint(directory, self.rank_state) or 0
        if self.rank_state is not None:
            self.rank_state.capture(self.step)
        if self.rt.rank == 0:
            self.rt.report(ReportKind.RESUMED, step=self.step, epoch=self.rt.epoch)
        return self.step

    def save_checkpoint(self, directory: Any, step: int, keep: int = 3) -> Path:
        """Write the checkpoint of ``step`` (collective: every rank calls it); the folder."""
        return self.training.save_checkpoint(directory, step, keep, self.rank_state)

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
            self.training.optimizer.zero_grad(set_to_none=True)
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
        switch = self.reconfigures.planned()
        if switch is not None:
            self.rt.log.info(
                "the switch after step %s is past the last step: switching now", switch.switch_after
            )
            self._reconfigure(switch)

    def _planned_switch_due(self) -> Reconfigure | None:
        """A planned migration whose switch step this rank has committed, if any."""
        return self.reconfigures.switch_due(self.step)

    @property
    def _pending(self) -> list[Reconfigure]:  # the reconfigures heard and not taken yet
        return self.reconfigures.pending

    def _next_reconfigure(self, timeout: datetime.timedelta) -> Reconfigure | None:
        """The pending or next reconfigure for a newer epoch."""
        return self.reconfigures.next(timeout, self.step)

    def _commit(self) -> None:
        release_kept()  # broken groups whose work has timed out: their destructors return at once
        self.training.optimizer.step()
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
        """Report the failed collective, then abort the broken groups (gloo: their sockets), so no
        peer waits on this rank until its timeout, and drop them (``rank/backends.py``, ``tear_down``).
        The report goes first: the supervisor hears at once that this rank
        is alive and recovering, however long the teardown takes. The group is never reused:
        :meth:`Runtime.rejoin` builds the next epoch's."""
        with stacks_if_slow(TEARDOWN_STACKS_S, self.rt.log):
            self.rt.report(
                ReportKind.COLLECTIVE_FAILED, step=self.step, error=str(exc)[:200], epoch=self.rt.epoch
            )
            keep_for = collective_timeout().total_seconds() + KEEP_BROKEN_MARGIN_S
            with group_backend(self.backend).tear_down(exc, self.rt.log, keep_for=keep_for):
                self._wrapped = None  # the DDP wrapper holds the group

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
        self._sync_state(body.leave if body.planned else ())
        self._restore_rank_state(self.step)
        self._wrap()
        self.migrations += 1
        self._first_step_pending = True

    def _release(self, body: Reconfigure) -> None:
        """This rank's node is drained: hand over (:meth:`Handover.leave`) and leave."""
        self.handover.leave(body, self.step)
        self.released = True
        self.rt.report(ReportKind.RELEASED, step=self.step, epoch=body.epoch)
        self.rt.log.info("released at step %d: this node is being drained", self.step)

    def _sync_state(self, leaving: Collection[int] = ()) -> None:
        """The state onto the new epoch's group, then the agreement on the committed step; ranks
        behind it receive the state from a replica, or from a rank in ``leaving`` (a drain)."""
        self.training.renew()
        self.step = self.handover.sync(self.step, leaving)

    def _restore_rank_state(self, step: int) -> None:
        """After the agreement on ``step``: this rank's own state is the one of that step (its own
        copy, or a promoted spare's copy of the lost rank's); RankStateError if there is none."""
        if self.rank_state is not None:
            promotion = self.rt.promotion if self.rt.is_spare_promoted else None
            self.rank_state.restore(step, promotion.rank_state if promotion is not None else ())

    def _wrap(self) -> None:
        """The model of this epoch's group (a fresh DDP wrapper, or none), hooked before its collectives."""
        self._wrapped = self.training.wrap(self._forward_called)

    def _forward_called(self, *_: object) -> None:
        """The model's forward is called: its collectives start here (a buffer broadcast,
        then the backward's all-reduce). The hang detector tells a rank stuck before them from
        peers waiting in them (``torchpass_slurm.phase``). The batch of this step is drawn: the
        rank state is the one valid once it commits, and its copy leaves before the all-reduce."""
        self.rt.state = Phase.SYNC
        if self.rank_state is not None:
            self.rank_state.capture(self.step + 1)
