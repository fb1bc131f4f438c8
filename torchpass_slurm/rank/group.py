"""The live process group: torn down as soon as it breaks, aborted from the heartbeat thread.

A survivor whose collective failed must close its sockets at once: a peer
that waits on it (in gloo's ring, another survivor, not the dead rank) sits
in its collective until the collective timeout otherwise, and the whole
recovery waits for it. Measured with ``python -m benchmarks.experiments.dead_collective``
(torch 2.13, gloo, 3 ranks, one killed): the peer left after 0.02 s when the
failed rank dropped every reference to the group and destroyed it, and only
at its collective timeout when the rank kept the group, or destroyed it
while its DDP wrapper still held it. ``destroy_process_group()`` forgets the
group but does not close gloo's pairs: they close when the last reference
(the DDP reducer, the failed call's frames) goes. Hence
:func:`release_references` before :func:`destroy_group`; neither holds the
GIL for long, so the heartbeat thread beats on through a teardown.

The failed rank shuts its own recorded sockets down first
(:func:`shut_down_broken_group`): dropping the group runs gloo's destructor, which waits
for the group's queued work (DDP's other buckets) to finish, with the GIL held. On the
dev cluster (torch 2.6) a rank whose peer was killed sat 5 s in ``destroy_process_group``,
its heartbeat thread starved, and with per-node heartbeats its whole node was declared
silent. With the sockets shut down, that work fails at once.

A frozen or powered-off peer sends nothing, so no teardown reaches the
survivors waiting on it; only an abort from another thread can
(:func:`abort_group_before`, called when the supervisor's reconfigure
arrives). torch's ``ProcessGroup.abort`` does not do it for gloo (torch
2.13: it returns at once and the collective in flight waits on; Debian's
torch 2.6 has none), so the abort shuts down the group's TCP sockets
itself: gloo connects its full mesh inside ``init_process_group`` (2.6 and
2.13; not with ``TORCH_GLOO_LAZY_INIT``), and :func:`group_sockets` records
the connected TCP sockets that appeared there, less the store's. A
``shutdown(SHUT_RDWR)`` on a duplicate of each wakes gloo's blocked read at
once: the collective raises ``[...pair.cc:N] Connection closed by peer``,
a comm error to ``is_comm_error`` (``benchmarks/experiments/dead_collective.py``, torch
2.13, a frozen peer: the survivors left 0.5 s after the freeze, when the
abort came, against the 15 s collective timeout without it; untried on
2.6). gloo's own descriptors are never closed, and a descriptor is only
touched while it is still the socket recorded (its inode, read through the
duplicate): a destroyed group's numbers may be reused. Linux only
(``/proc/self/fd``); elsewhere nothing is recorded and only
``ProcessGroup.abort`` is tried (NCCL aborts its communicators).

The group is process-global in torch (the default group), so its record is
here too: the group this rank trains in and its epoch, kept under a lock
that the training thread holds while it destroys the group. The heartbeat
thread never waits for that lock: a training thread that holds it has
already left its collective.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torchpass_slurm.control.bodies import Reconfigure

__all__ = [
    "GroupSocket",
    "socket_inodes",
    "group_sockets",
    "AbortAll",
    "adopt_group",
    "live_group",
    "adopt_subgroup_sockets",
    "destroy_group",
    "release_kept",
    "shut_down_broken_group",
    "tearing_down",
    "release_references",
    "superseding",
    "abort_group_before",
    "can_abort",
    "leave",
]

_logger = logging.getLogger(__name__)
_lock = threading.Lock()
#: Where a process's descriptors are listed (Linux).
PROC_FD = "/proc/self/fd"


@dataclass(frozen=True)
class GroupSocket:
    """One TCP socket of the group's mesh: gloo's descriptor and the socket's inode behind it."""

    fd: int
    inode: int


#: A backend's abort of every group of this rank at once (``rank/backends.py``: NCCL's group
#: abort); how many groups it aborted. None: gloo's, the recorded sockets shut down.
AbortAll = Callable[[logging.LoggerAdapter[logging.Logger]], int]


@dataclass
class _Live:
    """The default group as it was built for ``epoch``, its sockets; ``aborted`` once aborted;
    ``abort_all``: the backend's own abort, in place of the sockets' (NCCL)."""

    group: Any
    epoch: int
    sockets: tuple[GroupSocket, ...] = ()
    aborted: bool = False
    abort_all: AbortAll | None = None


_live: _Live | None = None


def _socket_inode(fd: int) -> int | None:
    """The inode of the socket behind ``fd`` (``socket:[N]`` in /proc); None for no socket."""
    try:
        target = os.readlink(f"{PROC_FD}/{fd}")
    except OSError:  # closed meanwhile
        return None
    if not (target.startswith("socket:[") and target.endswith("]")):
        return None
    return int(target[len("socket:[") : -1])


def socket_inodes() -> dict[int, int]:
    """Every socket this process holds, descriptor to inode; empty where there is no /proc/self/fd."""
    try:
        fds = [int(name) for name in os.listdir(PROC_FD)]
    except OSError:
        _logger.debug("no %s (not Linux): the group's sockets are not recorded", PROC_FD)
        return {}
    found = {fd: _socket_inode(fd) for fd in fds}
    return {fd: inode for fd, inode in found.items() if inode is not None}


def group_sockets(before: Mapping[int, int], exclude_ports: Collection[int]) -> tuple[GroupSocket, ...]:
    """The connected TCP sockets opened since ``before`` (:func:`socket_inodes` before
    ``init_process_group``), less any with an end at one of ``exclude_ports`` (the store's).

    gloo's listener is left out (it is not connected): shutting it down
    would only break its accept loop.
    """
    found = []
    for fd, inode in socket_inodes().items():
        if before.get(fd) == inode:
            continue
        candidate = GroupSocket(fd, inode)
        sock = _still_open(candidate)
        if sock is None:
            continue
        with sock:
            try:
                if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                    continue
                ports = (sock.getsockname()[1], sock.getpeername()[1])
            except OSError:  # not connected: a listener
                continue
        if not any(port in exclude_ports for port in ports):
            found.append(candidate)
    return tuple(found)


def _still_open(recorded: GroupSocket) -> socket.socket | None:
    """A socket object on a duplicate of ``recorded.fd`` while it is still the socket recorded.

    None when the descriptor is closed or now names another file (a
    destroyed group's number reused): its inode is read through the
    duplicate, so it cannot change between the check and the use. Closing
    the object closes the duplicate only.
    """
    try:
        dup = os.dup(recorded.fd)
    except OSError:
        return None
    try:
        if _socket_inode(dup) == recorded.inode:
            return socket.socket(fileno=dup)
    except OSError:
        pass
    os.close(dup)
    return None


def _shut_down(sockets: tuple[GroupSocket, ...], log: logging.LoggerAdapter[logging.Logger]) -> int:
    """``shutdown(SHUT_RDWR)`` each of ``sockets`` that is still open and still itself; how many."""
    done = 0
    for recorded in sockets:
        sock = _still_open(recorded)
        if sock is None:
            log.debug("socket fd %d (inode %d) is gone: left alone", recorded.fd, recorded.inode)
            continue
        with sock:
            try:
                sock.shutdown(socket.SHUT_RDWR)
                done += 1
            except OSError as exc:  # already shut down, or the peer reset it
                log.debug("shutting down socket fd %d: %r", recorded.fd, exc)
    return done


def adopt_group(epoch: int, sockets: tuple[GroupSocket, ...] = (), abort_all: AbortAll | None = None) -> None:
    """Record the default group just built as the one of ``epoch`` (after init_process_group),
    with the sockets :func:`group_sockets` found it opened, or the backend's ``abort_all``."""
    import torch.distributed as dist

    global _live
    with _lock:
        _live = _Live(dist.group.WORLD, epoch, sockets, abort_all=abort_all)


def live_group() -> tuple[int, bool] | None:
    """The recorded group's epoch and whether it was aborted; None when there is none."""
    live = _live
    return None if live is None else (live.epoch, live.aborted)


def adopt_subgroup_sockets(sockets: tuple[GroupSocket, ...]) -> int:
    """Add to the live group's record the sockets of groups built over it (a DeviceMesh's
    sub-groups: ``new_group`` connects a gloo mesh of its own), so that an abort shuts them
    down too. A rank of a sharded job blocks in a sub-group's collective on a survivor that has
    left it, never on the default group's sockets. How many sockets the record now holds."""
    with _lock:
        if _live is None:
            return 0
        known = {s.inode for s in _live.sockets}
        _live.sockets = _live.sockets + tuple(s for s in sockets if s.inode not in known)
        return len(_live.sockets)


def destroy_group(log: logging.LoggerAdapter[logging.Logger], *, keep_for: float = 0.0) -> None:
    """Destroy the current process group, if any; a group broken by a dead peer may complain.

    Safe when the group is already gone (a failed collective tore it down
    before the reconfigure came): the broken group is never reused. With
    ``keep_for`` (a broken group), torch forgets every group but their
    objects are kept that many seconds more (:func:`release_kept`): see
    :data:`_kept`.
    """
    import torch.distributed as dist

    global _live
    with _lock:
        _live = None  # the record must not keep the group's sockets open
        if not dist.is_initialized():
            return
        groups = _every_group() if keep_for > 0 else ()
        try:
            dist.destroy_process_group()
        except RuntimeError as exc:  # torch's errors (DistError too) are RuntimeErrors; it is gone anyway
            log.debug("destroying the process group: %r", exc)
        if groups:
            _kept.append((time.monotonic() + keep_for, groups))


#: Broken groups that torch has forgotten but this module still holds, each with the time
#: (monotonic) after which it may go. The last reference to a gloo group runs its destructor,
#: which waits for the group's work in flight; in Debian's torch 2.6 it does so holding the
#: GIL. A survivor whose peer died can have work that waits out the collective timeout even
#: with the group's sockets shut down: on the dev cluster its ``destroy_process_group()`` then
#: held the GIL for seconds, its heartbeat thread starved, and its node was declared hung
#: (issue 21; ``faulthandler`` showed the training thread in ``destroy_process_group`` and the
#: heartbeat thread waiting). Kept past the collective timeout, the group's work has ended and
#: its destructor returns at once.
_kept: list[tuple[float, tuple[Any, ...]]] = []


def _every_group() -> tuple[Any, ...]:
    """The default group and every group built over it (a device mesh's), as torch lists them."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    world = getattr(distributed_c10d, "_world", None)
    groups = tuple(getattr(world, "pg_map", None) or ())
    return groups or (dist.group.WORLD,)


def release_kept(now: float | None = None) -> int:
    """Let go of the broken groups kept past their time (call it where a pause of a few
    milliseconds is harmless: a step boundary); how many groups went."""
    if not _kept:
        return 0
    now = time.monotonic() if now is None else now
    due = [entry for entry in _kept if entry[0] <= now]
    if not due:
        return 0
    _kept[:] = [entry for entry in _kept if entry[0] > now]
    released = sum(len(groups) for _, groups in due)
    due.clear()  # the last references: the groups' destructors run here
    return released


def shut_down_broken_group(log: logging.LoggerAdapter[logging.Logger]) -> int:
    """This rank's collective failed: shut the live group's recorded sockets down before anything
    drops the group (see the module doc), so that no queued work holds its destructor. How many
    were shut down (0 when there is no record, or an abort did it already). The group is never
    used again: every failure is followed by a new epoch."""
    with _lock:
        live = _live
        if live is None or live.aborted:
            return 0
        live.aborted = True
        if live.abort_all is not None:
            return live.abort_all(log)
        return _shut_down(live.sockets, log)


@contextlib.contextmanager
def stacks_if_slow(seconds: float, log: logging.LoggerAdapter[logging.Logger]) -> Iterator[None]:
    """Write every thread's stack to stderr if the ``with`` body takes longer than ``seconds``.

    ``faulthandler``'s watchdog is a C thread: it writes even while another thread holds the
    GIL, which is when a rank's heartbeat goes quiet and nothing else can say where it is.
    """
    import faulthandler
    import sys

    try:
        faulthandler.dump_traceback_later(seconds, exit=False, file=sys.stderr)
    except (AttributeError, ValueError, OSError, RuntimeError):  # no real stderr (a test's capture)
        yield
        return
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
    log.debug("no stacks needed: done within %.1f s", seconds)


@contextlib.contextmanager
def tearing_down(
    exc: BaseException, log: logging.LoggerAdapter[logging.Logger], *, keep_for: float = 0.0
) -> Iterator[None]:
    """Tear down the group that ``exc``, a failed collective, broke: its sockets are shut down
    first (:func:`shut_down_broken_group`), the caller drops what it holds of the group in the
    ``with`` body (the DDP wrapper), then the failure's frames go and the group is destroyed,
    its objects kept ``keep_for`` seconds more (the collective timeout: see :data:`_kept`)."""
    marks = [time.monotonic()]
    shut = shut_down_broken_group(log)
    marks.append(time.monotonic())
    yield
    marks.append(time.monotonic())
    release_references(exc)
    marks.append(time.monotonic())
    destroy_group(log, keep_for=keep_for)
    marks.append(time.monotonic())
    parts = ", ".join(
        f"{name} {b - a:.2f} s"
        for name, a, b in zip(("sockets", "wrapper", "frames", "destroy"), marks[:-1], marks[1:], strict=True)
    )
    log.info("broken group torn down in %.2f s (%d sockets shut down; %s)", marks[-1] - marks[0], shut, parts)


def release_references(exc: BaseException) -> None:
    """Drop what a failed collective's exception holds: the locals of its frames, chained ones too.

    The step function's frame holds the DDP wrapper, torch's the failed
    work; either keeps the group alive. Cleared, reference counting frees
    them at once.

    No garbage collection runs here. A full ``gc.collect()`` walks every
    object of the process with the GIL held, and the rank's heartbeat
    thread, its only voice to the supervisor, waits for it all that time:
    on the dev cluster (torch 2.6, 6 ranks on a loaded 2-core host) it was
    0.8 to 1.0 s of a 0.8 to 1.05 s teardown, and a rank behind its node's
    beats went silent long enough for its whole node to be declared hung
    (issue 21). A wrapper that a reference cycle keeps is left to Python's
    own collector: its group's sockets are shut down already, so no peer
    waits on it.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current = current.__cause__ or current.__context__


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
    it: the group's recorded sockets are shut down (see the module doc), then
    ``ProcessGroup.abort`` runs where torch has one. Nothing happens when the
    group is already gone or replaced (its epoch is ``epoch`` or later), was
    aborted before, when the training thread is destroying it (it holds the
    lock: it is out of its collective), or when there is neither a socket nor
    ``abort``.
    """
    if not _lock.acquire(blocking=False):
        return False
    try:
        live = _live
        if live is None or live.epoch >= epoch or live.aborted:
            return False
        if live.abort_all is not None:  # NCCL: every group at once (rank/backends.py)
            live.aborted = True
            aborted = live.abort_all(log)
            log.warning(
                "aborted %d process groups of epoch %d at once: epoch %d replaces them",
                aborted,
                live.epoch,
                epoch,
            )
            return aborted > 0
        if not live.sockets and not can_abort(live.group):
            return False
        live.aborted = True
        shut = _shut_down(live.sockets, log)
        aborted = can_abort(live.group) and _abort(live.group, live.epoch, log)
        if not (shut or aborted):
            return False
        log.warning(
            "aborted the process group of epoch %d (%d of %d sockets shut down): epoch %d replaces it",
            live.epoch,
            shut,
            len(live.sockets),
            epoch,
        )
        return True
    finally:
        _lock.release()


def _abort(group: Any, epoch: int, log: logging.LoggerAdapter[logging.Logger]) -> bool:
    try:
        group.abort()
    except RuntimeError as exc:  # a backend that cannot abort says so; the collective timeout bounds it
        log.debug("aborting the group of epoch %d: %r", epoch, exc)
        return False
    return True


def leave(code: int = 0) -> None:
    """End a training process whose work is done (its checkpoints written, its group closed):
    flush its output and logs, then exit with ``code`` without the interpreter's finalization.

    A gloo group's threads, or the tensors their finished work still holds, can outlive
    :func:`destroy_group`; torch then frees them while the interpreter shuts down, and the
    process ends with SIGABRT ("terminate called without an active exception",
    pytorch/pytorch#179291: measured once in 40 two-rank runs of ``sbatch-examples/tiny_gpt.py``,
    and a rank that ends with a signal is a fault to the supervisor). Freeing them earlier
    instead (the DDP wrapper dropped, a garbage collection) hung once in 80 runs.
    """
    import sys

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    logging.shutdown()
    os._exit(code)
