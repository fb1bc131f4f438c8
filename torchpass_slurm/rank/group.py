"""The live process group: torn down as soon as it breaks, aborted from the heartbeat thread.

A survivor whose collective failed must close its sockets at once: a peer
that waits on it (in gloo's ring, another survivor, not the dead rank) sits
in its collective until the collective timeout otherwise, and the whole
recovery waits for it. Measured with ``python -m benchmarks.dead_collective``
(torch 2.13, gloo, 3 ranks, one killed): the peer left after 0.02 s when the
failed rank dropped every reference to the group and destroyed it, and only
at its collective timeout when the rank kept the group, or destroyed it
while its DDP wrapper still held it. ``destroy_process_group()`` forgets the
group but does not close gloo's pairs: they close when the last reference
(the DDP reducer, the failed call's frames) goes. Hence
:func:`release_references` before :func:`destroy_group`.

A frozen or powered-off peer sends nothing, so no teardown reaches the
survivors waiting on it; only an abort from another thread could
(:func:`abort_group_before`, called when the supervisor's reconfigure
arrives). It is feature-detected: torch's ``ProcessGroup.abort``, where
there is one (NCCL aborts its communicators; measured on torch 2.13, gloo's
returns at once without ending a collective in flight); none on Debian's
torch 2.6, where it is a no-op.

The group is process-global in torch (the default group), so its record is
here too: the group this rank trains in and its epoch, kept under a lock
that the training thread holds while it destroys the group. The heartbeat
thread never waits for that lock: a training thread that holds it has
already left its collective.
"""

from __future__ import annotations

import gc
import logging
import threading
import traceback
from dataclasses import dataclass
from typing import Any

from torchpass_slurm.control.bodies import Reconfigure

__all__ = [
    "adopt_group",
    "destroy_group",
    "release_references",
    "superseding",
    "abort_group_before",
    "can_abort",
]

_lock = threading.Lock()


@dataclass
class _Live:
    """The default group as it was built for ``epoch``; ``aborted`` once aborted."""

    group: Any
    epoch: int
    aborted: bool = False


_live: _Live | None = None


def adopt_group(epoch: int) -> None:
    """Record the default group just built as the one of ``epoch`` (after init_process_group)."""
    import torch.distributed as dist

    global _live
    with _lock:
        _live = _Live(dist.group.WORLD, epoch)


def destroy_group(log: logging.LoggerAdapter[logging.Logger]) -> None:
    """Destroy the current process group, if any; a group broken by a dead peer may complain.

    Safe when the group is already gone (a failed collective tore it down
    before the reconfigure came): the broken group is never reused.
    """
    import torch.distributed as dist

    global _live
    with _lock:
        _live = None  # the record must not keep the group's sockets open
        if not dist.is_initialized():
            return
        try:
            dist.destroy_process_group()
        except RuntimeError as exc:  # torch's errors (DistError too) are RuntimeErrors; it is gone anyway
            log.debug("destroying the process group: %r", exc)


def release_references(exc: BaseException) -> None:
    """Drop what a failed collective's exception holds: the locals of its frames, chained ones too.

    The step function's frame holds the DDP wrapper, torch's the failed
    work; either keeps the group, and so its sockets, alive. Then collect,
    for the reference cycles a module may have.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current = current.__cause__ or current.__context__
    gc.collect()


def superseding(body: Reconfigure, log: logging.LoggerAdapter[logging.Logger]) -> Reconfigure:
    """Abort the group an unplanned reconfigure supersedes (from the heartbeat thread); ``body``.

    A planned one is left alone: the old group trains on until the announced
    switch step, and the ranks leave it in order.
    """
    if not body.planned:
        abort_group_before(body.epoch, log)
    return body


def can_abort(group: Any) -> bool:
    """True when the torch in use can abort ``group`` (``ProcessGroup.abort``; not in torch 2.6)."""
    return callable(getattr(group, "abort", None))


def abort_group_before(epoch: int, log: logging.LoggerAdapter[logging.Logger]) -> bool:
    """Abort the group if it belongs to an epoch before ``epoch``; True when it was aborted.

    Called from the heartbeat thread when a reconfigure to ``epoch`` arrives,
    so that a training thread stuck in a collective of the old group leaves
    it. Nothing happens when the group is already gone or replaced (its
    epoch is ``epoch`` or later), was aborted before, when the training
    thread is destroying it (it holds the lock: it is out of its collective),
    or when the torch in use cannot abort.
    """
    if not _lock.acquire(blocking=False):
        return False
    try:
        live = _live
        if live is None or live.epoch >= epoch or live.aborted or not can_abort(live.group):
            return False
        live.aborted = True
        try:
            live.group.abort()
        except RuntimeError as exc:  # a backend that cannot abort says so; the collective timeout bounds it
            log.debug("aborting the group of epoch %d: %r", live.epoch, exc)
            return False
        log.warning("aborted the process group of epoch %d: epoch %d replaces it", live.epoch, epoch)
        return True
    finally:
        _lock.release()
