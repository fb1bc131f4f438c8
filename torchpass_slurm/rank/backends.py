"""The process-group seam: how this rank's groups are built, aborted, torn down and rebuilt,
behind one small interface with two backends, gloo's and NCCL's.

API (stable: the rank side and ``scripts/gpu-check`` call it; nothing else builds or aborts
a group)::

    choose_backend(requested, device)        -> str         "auto": the rule below; a name: itself
    group_backend(name | backend)            -> GroupBackend  GlooBackend, or NcclBackend for a NCCL name
    backend.name                             the backend init_process_group is given
    backend.create(info, timeout, log, store=None) -> int
        build and record (group.adopt_group) the default group of ``info.epoch``: in ``store``
        (the epoch's PrefixStore in the job's store), else at env://; the sockets recorded
    backend.abort_all(log)                   -> bool        every group of this rank at once, from
        any thread, never waiting for a collective (the supervisor's word: group.abort_group_before)
    backend.tear_down(exc, log, keep_for)    context manager: the groups an observed error broke
    backend.rebuild(request, fresh, log)     -> Rebuild     the next epoch's group: the live one
        shrunk, or the old one destroyed and ``fresh()`` (the epoch store's rendezvous) called
    choose_rebuild(request, caps, live)      -> Rebuild     pure: the table below
    RebuildRequest(epoch, old_world, new_world, excluded)   .rank_after(rank): a rank once shrunk
    nccl_capabilities()                      -> NcclCapabilities  what this torch and NCCL offer
    nccl_options()                           ProcessGroupNCCL.Options with config.blocking = 0
    recovery_env_problems(environ)           -> list[str]   NCCL settings that defeat recovery

The backend rule: a name given (``ElasticTrainer(backend=...)``, ``Runtime.init_process_group``)
is used as it is; ``"auto"`` is ``"nccl"`` when the training's device (a DDP model's
parameters, a sharded state's ``device_type``) is CUDA and torch has NCCL, else ``"gloo"``.
A name that holds ``nccl`` (``"cpu:gloo,cuda:nccl"``) gets the NCCL backend; every other one
gloo's, whose sockets are recorded for the name ``"gloo"`` alone, as before this seam.

gloo: exactly the behaviour of ``rank/group.py`` (the recorded mesh sockets shut down,
``ProcessGroup.abort`` where torch has one). NCCL (``docs/design/nccl.md``)::

    create      non-blocking communicators (Options.config.blocking = 0, and
                TORCH_NCCL_USE_COMM_NONBLOCKING=1 from tp run for a mesh's sub-groups), eagerly
                connected (device_id=cuda:<local rank>): the communicator exists before the first
                collective, so an abort never meets one half built
    abort_all   every group of the rank, a DeviceMesh's too, in one ncclGroupStart/End; if that
                raises, each group's own ``abort()``. Never waits for a collective; torch's list
                of groups is left alone (the training thread's next collective must fail)
    tear_down   the same abort, then torch's ``_abort_process_group()`` forgets the groups, so
                no destroy_process_group meets a broken communicator (NCCL's may wait on it)
    rebuild     see the table; after an abort, always a fresh communicator through the epoch store

The rebuild decision (:func:`choose_rebuild`; ``tests/unit/nccl`` is its table test)::

    shrink offered  group live  excluded named  new world = old - excluded    -> rebuild
    no              -           -               -                                FRESH
    yes             no          -               -                                FRESH   the abort freed it
    yes             yes         no              -                                FRESH   who left is unknown
    yes             yes         yes             no (a spare joins)               FRESH   no grow in torch
    yes             yes         yes             yes                              SHRINK

torch 2.13 wraps ncclCommShrink (``shrink_group``, NCCL >= 2.27.3) but not ncclCommGrow: a
spare can only join a fresh communicator, so shrinking first would cost a shrink and buy
nothing. Every reconfigure the supervisor sends today keeps the world (a spare takes the lost
rank) and names no excluded rank, so :meth:`Runtime.rejoin` always builds FRESH; SHRINK is
there for a caller that shrinks the world (``scripts/gpu-check``; ``--elastic``, not built).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from torchpass_slurm.rank.group import (
    abort_group_before,
    adopt_group,
    destroy_group,
    group_sockets,
    live_group,
    socket_inodes,
    tearing_down,
)
from torchpass_slurm.rank.nccl_support import (
    SHRINK_MIN_NCCL,
    NcclCapabilities,
    nccl_capabilities,
    nccl_options,
    recovery_env_problems,
)
from torchpass_slurm.rank.rankinfo import RankInfo
from torchpass_slurm.strenum import StrEnum

__all__ = [
    "AUTO",
    "GroupBackend",
    "GlooBackend",
    "NcclBackend",
    "NcclCapabilities",
    "Rebuild",
    "RebuildRequest",
    "choose_backend",
    "choose_rebuild",
    "group_backend",
    "nccl_capabilities",
    "nccl_options",
    "recovery_env_problems",
    "training_device",
    "SHRINK_MIN_NCCL",
]

Log = logging.LoggerAdapter[logging.Logger]
#: The backend name that asks for the rule of the module doc.
AUTO = "auto"
#: Larger than any epoch: :meth:`GroupBackend.abort_all` aborts whatever group is live.
_ANY_EPOCH = sys.maxsize


class Rebuild(StrEnum):
    """How the next epoch's group came to be."""

    FRESH = "fresh"  # the old group destroyed (or aborted), a new one through the epoch store
    SHRINK = "shrink"  # the live group shrunk to its survivors (NCCL >= 2.27.3)


@dataclass(frozen=True)
class RebuildRequest:
    """The step from one epoch's group to the next: the worlds, and the ranks that leave it
    without a successor (empty when unknown: a reconfigure names none)."""

    epoch: int
    old_world: int
    new_world: int
    excluded: tuple[int, ...] = ()

    @property
    def shrinks(self) -> bool:
        """True when the new world is exactly the old one less the excluded ranks (no newcomer)."""
        left = set(self.excluded)
        return (
            bool(left)
            and all(0 <= r < self.old_world for r in left)
            and (self.new_world == self.old_world - len(left))
        )

    def rank_after(self, rank: int) -> int:
        """``rank`` once the group is shrunk: the excluded ranks' gaps closed, as ncclCommShrink does."""
        if not self.shrinks:
            return rank
        return rank - sum(1 for r in set(self.excluded) if r < rank)


def choose_rebuild(request: RebuildRequest, caps: NcclCapabilities, live: bool) -> Rebuild:
    """The rebuild of the module doc's table (pure). ``live``: the old group is still up (not aborted)."""
    if caps.shrink and live and request.shrinks:
        return Rebuild.SHRINK
    return Rebuild.FRESH


def choose_backend(requested: str | None, device: Any = None) -> str:
    """The backend: ``requested`` when it is a name, else (None, ``"auto"``) NCCL for a CUDA
    ``device`` (a ``torch.device`` or its type) when torch has NCCL, else gloo."""
    if requested is not None and requested != AUTO:
        return requested
    kind = getattr(device, "type", device)
    if kind == "cuda":
        import torch.distributed as dist

        if dist.is_nccl_available():
            return "nccl"
    return "gloo"


def training_device(training: Any) -> Any:
    """The device a training runs on: its ``device_type`` (a sharded state), else its model's
    first parameter's device; None when neither says."""
    kind = getattr(training, "device_type", None)
    if isinstance(kind, str):
        return kind
    try:
        return next(training.model.parameters()).device
    except (AttributeError, StopIteration, RuntimeError):  # no model yet, or no parameter
        return None


class GroupBackend(Protocol):
    """What the rank side needs of a backend (module doc)."""

    name: str

    def create(self, info: RankInfo, timeout: datetime.timedelta, log: Log, store: Any = None) -> int: ...

    def abort_all(self, log: Log) -> bool: ...

    def tear_down(
        self, exc: BaseException, log: Log, keep_for: float = 0.0
    ) -> contextlib.AbstractContextManager[None]: ...

    def rebuild(self, request: RebuildRequest, fresh: Callable[[], None], log: Log) -> Rebuild: ...


class _Common:
    """What both backends do alike: abort through the live record, tear down, destroy."""

    name: str

    def abort_all(self, log: Log) -> bool:
        """Abort the live group, whatever its epoch: the record knows how (group.py)."""
        return abort_group_before(_ANY_EPOCH, log)

    @contextlib.contextmanager
    def tear_down(self, exc: BaseException, log: Log, keep_for: float = 0.0) -> Iterator[None]:
        """After ``exc``, an observed error: the groups aborted (gloo: their sockets shut down)
        before the caller drops its references in the ``with`` body, then destroyed."""
        with tearing_down(exc, log, keep_for=keep_for):
            yield

    def rebuild(self, request: RebuildRequest, fresh: Callable[[], None], log: Log) -> Rebuild:
        """Destroy the old group (gone already when it was aborted) and build the next: ``fresh()``."""
        destroy_group(log)
        fresh()
        return Rebuild.FRESH


def _init_kwargs(info: RankInfo, name: str, timeout: datetime.timedelta, store: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "backend": name,
        "rank": info.rank,
        "world_size": info.world_size,
        "timeout": timeout,
    }
    if store is not None:
        kwargs["store"] = store
    else:
        kwargs["init_method"] = "env://"
    return kwargs


class GlooBackend(_Common):
    """gloo (and any backend that is not NCCL): the group's mesh sockets recorded at init, for
    the abort of ``rank/group.py``."""

    def __init__(self, name: str = "gloo") -> None:
        self.name = name

    def create(self, info: RankInfo, timeout: datetime.timedelta, log: Log, store: Any = None) -> int:
        import torch.distributed as dist

        before = socket_inodes()  # gloo connects its mesh in init_process_group (group.py)
        dist.init_process_group(**_init_kwargs(info, self.name, timeout, store))
        # Only gloo's: NCCL's own abort ends its collectives, and no socket where gloo connects
        # lazily (TORCH_GLOO_LAZY_INIT): the abort is then ProcessGroup.abort alone.
        port = int(info.store_port or 0) if store is not None else (info.master_port or 0)
        sockets = group_sockets(before, exclude_ports={port}) if self.name == "gloo" else ()
        adopt_group(info.epoch, sockets)
        return len(sockets)


class NcclBackend(_Common):
    """NCCL: non-blocking, eagerly connected communicators, all aborted at once (module doc).

    Every torch call it makes is injectable, so that the unit tests run this class's own
    orchestration under torch's ``fake`` backend (``tests/unit/nccl``): ``name`` the backend
    init_process_group is given, ``options`` the pg_options (None: none), ``device`` the
    device_id for a rank (None: no eager connect), ``abort_every`` the group abort of the
    listed groups' communicators, ``forget_every`` torch's ``_abort_process_group()`` (abort and
    forget), ``shrink`` torch's shrink_group, ``capabilities`` what torch offers.

    Two aborts, for two threads. The heartbeat thread's (the supervisor's word) aborts the
    communicators and leaves torch's list of groups alone: the training thread may be between
    two collectives, and its next one must fail as a comm error (``is_comm_error``), not find
    the default group gone (a ValueError: the rank would end). The training thread's own
    (:meth:`tear_down`, :meth:`rebuild`) then has torch abort them again, a no-op on an aborted
    communicator, and forget them, so that nothing destroys a broken communicator.
    """

    def __init__(
        self,
        name: str = "nccl",
        *,
        options: Callable[[], Any] | None = nccl_options,
        device: Callable[[RankInfo], Any] | None = None,
        abort_every: Callable[[list[Any]], None] | None = None,
        forget_every: Callable[[], None] | None = None,
        shrink: Callable[[list[int]], Any] | None = None,
        capabilities: Callable[[], NcclCapabilities] = nccl_capabilities,
    ) -> None:
        self.name = name
        self._options = options
        self._device = _local_cuda_device if device is None else device
        self._abort_every = abort_every or _group_abort
        self._forget_every = forget_every or _torch_abort_and_forget
        self._shrink = shrink or _torch_shrink
        self._capabilities = capabilities

    def create(self, info: RankInfo, timeout: datetime.timedelta, log: Log, store: Any = None) -> int:
        import torch.distributed as dist

        problems = recovery_env_problems(os.environ)
        if problems:
            log.warning(
                "NCCL settings that defeat in-process recovery (a watchdog may end this rank, or an "
                "abort may hang): %s; unset them and tp run sets each (docs/design/nccl.md)",
                ", ".join(problems),
            )
        kwargs = _init_kwargs(info, self.name, timeout, store)
        if self._options is not None:
            kwargs["pg_options"] = self._options()
        device = self._device(info)
        if device is not None:  # eager: the communicator exists before the first collective
            kwargs["device_id"] = device
            _pin(device)
        dist.init_process_group(**kwargs)
        adopt_group(info.epoch, (), abort_all=self.abort_groups)
        return 0

    def abort_groups(self, log: Log) -> int:
        """Abort the communicators of every group torch lists for this rank, at once, from any
        thread; how many. One group abort first; if it raises, each group's ``abort()`` (one that
        raises too is left to NCCL's timeout). Never waits for a collective: a non-blocking
        communicator aborts at once. torch's list of groups is left as it is (class doc)."""
        groups = _torch_groups()
        if not groups:
            return 0
        started = time.monotonic()
        try:
            self._abort_every(groups)
            aborted = len(groups)
        except Exception as exc:  # whatever torch raises, this rank must still get out
            log.warning("the group abort of %d process groups failed (%r): aborting each", len(groups), exc)
            aborted = sum(_abort_one(g, log) for g in groups)
        log.info(
            "%d of %d process groups aborted in %.3f s", aborted, len(groups), time.monotonic() - started
        )
        return aborted

    def forget(self, log: Log) -> bool:
        """On the training thread: torch's ``_abort_process_group()`` aborts every group (again,
        after the heartbeat thread's abort) and forgets them; True when it did. If it raises,
        the groups stay listed and ``destroy_group`` destroys them."""
        if not _torch_groups():
            return False
        try:
            self._forget_every()
        except Exception as exc:  # whatever torch raises, the teardown goes on
            log.warning("torch's abort of every process group failed: %r", exc)
            return False
        return True

    @contextlib.contextmanager
    def tear_down(self, exc: BaseException, log: Log, keep_for: float = 0.0) -> Iterator[None]:
        """After ``exc``: every communicator aborted (unless the supervisor's word did it) and
        the groups forgotten before the caller drops its references; then nothing is left for
        ``destroy_process_group``."""
        with tearing_down(exc, log, keep_for=keep_for):
            self.forget(log)
            yield

    def rebuild(self, request: RebuildRequest, fresh: Callable[[], None], log: Log) -> Rebuild:
        """Shrink the live group when the table says so (a failed shrink: abort, then fresh),
        else destroy it (forget it, when it was aborted) and build ``fresh()``."""
        live = live_group()
        choice = choose_rebuild(request, self._capabilities(), live is not None and not live[1])
        if choice is Rebuild.SHRINK:
            started = time.monotonic()
            try:
                self._shrink(sorted(set(request.excluded)))
            except (TypeError, ValueError, RuntimeError) as exc:  # not supported, or a fault during it
                log.warning(
                    "shrinking to epoch %d failed (%r): aborting, then a fresh group", request.epoch, exc
                )
                self.abort_all(log)
                self.forget(log)
            else:
                adopt_group(request.epoch, (), abort_all=self.abort_groups)
                log.info(
                    "group of epoch %d shrunk by %s in %.3f s",
                    request.epoch,
                    request.excluded,
                    time.monotonic() - started,
                )
                return Rebuild.SHRINK
        if live is not None and live[1]:  # aborted: never destroy a broken communicator
            self.forget(log)
        return super().rebuild(request, fresh, log)


def group_backend(backend: str | GroupBackend) -> GroupBackend:
    """The backend of a name (module doc), or ``backend`` itself when it is one already."""
    if not isinstance(backend, str):
        return backend
    return NcclBackend(backend) if "nccl" in backend else GlooBackend(backend)


def _local_cuda_device(info: RankInfo) -> Any:
    """cuda:<local rank> (modulo the devices this process sees: one each under CUDA_VISIBLE_DEVICES)."""
    import torch

    count = torch.cuda.device_count()
    return torch.device("cuda", info.local_rank % count) if count else None


def _pin(device: Any) -> None:
    """Make ``device`` (cuda:<local rank>) this process's current GPU: with N ranks on a node, each
    rank's tensors, NCCL's streams and a spare taking the rank land on the rank's own GPU."""
    if getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.set_device(device)


def _torch_groups() -> list[Any]:
    """Every group torch knows in this process (the default one and a mesh's), as it lists them."""
    from torch.distributed import distributed_c10d

    world = getattr(distributed_c10d, "_world", None)
    return list(getattr(world, "pg_map", None) or ())


def _group_abort(groups: list[Any]) -> None:
    """Every group's ``abort()`` inside one ncclGroupStart/End where the default group is
    NCCL's (as torch's ``_abort_process_group`` does: aborts of communicators that share a stream,
    one after the other, can hang each other, pytorch#119797), the mesh's groups before the
    default one; torch's list of groups is left alone."""
    import torch
    from torch.distributed import distributed_c10d

    world = distributed_c10d.GroupMember.WORLD
    backend: Any
    try:
        backend = world._get_backend(torch.device("cuda")) if world is not None else None
    except RuntimeError:  # no CUDA backend in the default group
        backend = None
    grouped = distributed_c10d.is_nccl_available() and isinstance(backend, distributed_c10d.ProcessGroupNCCL)
    if grouped:
        backend._group_start()
    try:
        for pg in reversed(groups):
            pg.abort()
    finally:
        if grouped:
            backend._group_end()


def _torch_abort_and_forget() -> None:
    from torch.distributed import distributed_c10d

    distributed_c10d._abort_process_group()


def _torch_shrink(excluded: list[int]) -> Any:
    from torch.distributed import distributed_c10d

    return distributed_c10d.shrink_group(excluded, shrink_flags=distributed_c10d.SHRINK_ABORT)


def _abort_one(group: Any, log: Log) -> int:  # 1 when aborted
    try:
        group.abort()
    except Exception as exc:  # one group's failure must not keep the others alive
        log.warning("aborting process group %r: %r", getattr(group, "group_name", group), exc)
        return 0
    return 1
