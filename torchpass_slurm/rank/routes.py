"""The route of one state transfer: which transport carries it, and how its two ends meet.

The job's transport setting (``TORCHPASS_TRANSPORT``, config.py) picks the route of a replica
donor; a rank leaving by a drain is outside the new group and always uses its socket
(``rank/handover.py``)::

    setting       replica donor -> receiver                          fallback
    auto, torch   the epoch's torch group (TorchTransport)              -
    socket        a sealed TCP socket of the donor's own                the group
    mpi           MPIProcessTransport: MPICH connect/accept, run by a   the group
                  helper process of each end (transfer/mpi_process.py)

A route of its own meets through the job's store, under this epoch's prefix: the donor
publishes ``{"kind", "address", "tag"}`` at :data:`ROUTE_KEY` (an MPI port name, or
``host:port``; ``tag`` is the MAC of the address with the transfer's seal, so the receiver
refuses an address an outsider wrote) or ``{"kind": "none", "why"}`` when it cannot open one
(no MPICH mpiexec.hydra, or the helper's MPI failed to start: the rank itself never imports
mpi4py). A receiver that cannot take the route (its own helper failed, the route is not
sealed) writes its reason at ``ROUTE_KEY + "/refused"``; a donor waiting in ``Accept`` reads
it and stops waiting.

Every failure of a route of its own falls back to the group, on both ends, and never hangs:

- meeting: each end waits at most :data:`ROUTE_CONNECT_TIMEOUT`, its helper's start included
  (a helper still in MPI's ``Accept``/``Connect`` at the deadline is killed);
- moving: over MPI each wait of the stream may make no progress for at most
  :data:`MPI_STALL_TIMEOUT`, which bounds a dead *remote* peer (MPICH does not report one:
  only a timeout does); a dead *local* helper is an EOF on its socket, reported at once;
- the fallback stream over the group resumes from the chunks already verified when the state
  is resumable (``ReceiveProgress``), and a donor that died fails the fallback at once, so the
  next epoch resumes from another donor, as with any failed transfer.

Both ends reach the same fallback whichever of them failed first: the donor's fallback send
waits up to ``TRANSFER_TIMEOUT`` for a receiver still in its bounded MPI wait, and the other way
round. The manifest, chunks and seal are those of every transfer (``send_state``/``recv_state``).
"""

from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from torchpass_slurm.errors import TransferError

if TYPE_CHECKING:
    from torchpass_slurm.transfer import ReceiveProgress, TransferStats, Transport
    from torchpass_slurm.transfer.seal import Seal

__all__ = [
    "GROUP",
    "MPI_STALL_TIMEOUT",
    "ROUTE_CONNECT_TIMEOUT",
    "ROUTE_KEY",
    "ROUTE_TRANSFER_TIMEOUT",
    "receive_routed",
    "route_of",
    "send_routed",
]

logger = logging.getLogger(__name__)

#: The route over the epoch's torch.distributed group.
GROUP = "group"
#: The store key (under the epoch's prefix) where a donor publishes its own route.
ROUTE_KEY = "torchpass/route/{donor}-{receiver}"
#: How long a donor waits for its receiver to connect over a route of its own, and the receiver
#: for the donor's address and its connection; past it both fall back to the group.
ROUTE_CONNECT_TIMEOUT = datetime.timedelta(seconds=30)
#: Over MPI, how long one wait of the stream may make no progress before the transfer falls
#: back: MPICH over UCX/TCP does not report a dead remote peer (docs/design/transfer.md), so
#: this, not ``ROUTE_TRANSFER_TIMEOUT``, bounds what a dead donor costs its receiver. (A dead
#: local helper is reported at once.)
MPI_STALL_TIMEOUT = datetime.timedelta(seconds=15)
#: One wait of a stream over the group or a socket (both report a dead peer at once), and of
#: the fallback; the value of ``rank/handover.py``'s TRANSFER_TIMEOUT.
ROUTE_TRANSFER_TIMEOUT = datetime.timedelta(seconds=120)

Log = logging.Logger | logging.LoggerAdapter[Any]


def route_of(setting: str) -> str:
    """The route of a replica donor's transfer under the transport ``setting``."""
    return setting if setting in ("socket", "mpi") else GROUP


def _stall(kind: str) -> datetime.timedelta:
    return MPI_STALL_TIMEOUT if kind == "mpi" else ROUTE_TRANSFER_TIMEOUT


# --- the donor ------------------------------------------------------------------------------


def send_routed(
    kind: str,
    store: Any,
    key: str,
    seal: Seal,
    host: str,
    state: Mapping[str, Any],
    meta: Any,
    fallback: Callable[[], Transport],
    log: Log = logger,
) -> tuple[TransferStats, str]:
    """Send ``state`` over the route ``kind`` (socket or mpi), else over ``fallback()``; the
    stats and the route that carried it."""
    from torchpass_slurm.transfer import send_state

    try:
        transport = _open_donor(kind, store, key, seal, host)
    except TransferError as exc:
        log.warning("no %s route to the receiver (%s); sending over the group", kind, exc)
    else:
        try:
            return send_state(transport, state, timeout=_stall(kind), meta=meta, seal=seal), kind
        except TransferError as exc:
            log.warning("the %s transfer failed (%s); sending over the group", kind, exc)
        finally:
            transport.close()
    stats = send_state(fallback(), state, timeout=ROUTE_TRANSFER_TIMEOUT, meta=meta, seal=seal)
    return stats, GROUP


def _open_donor(kind: str, store: Any, key: str, seal: Seal, host: str) -> Transport:
    """Publish this donor's own route at ``key`` and take the receiver's connection."""
    if kind == "socket":
        from torchpass_slurm.transfer import SocketListener

        with SocketListener(host, 0) as listener:
            _publish(store, key, kind, f"{host}:{listener.port}", seal)
            return listener.accept_sealed(seal, ROUTE_CONNECT_TIMEOUT)
    from torchpass_slurm.transfer.mpi_process import MPIProcessTransport

    published: list[str] = []

    def publish(port: str) -> None:
        _publish(store, key, kind, port, seal)
        published.append(port)

    def refused() -> str | None:
        if not store.check([f"{key}/refused"]):
            return None
        reason: bytes = store.get(f"{key}/refused")
        return "the receiver refused: " + reason.decode("utf-8", errors="replace")

    try:
        return MPIProcessTransport.accept(publish, ROUTE_CONNECT_TIMEOUT, cancelled=refused)
    except TransferError as exc:
        if not published:  # the receiver falls back at once instead of waiting for a port
            store.set(key, json.dumps({"kind": "none", "why": str(exc).splitlines()[0][:500]}))
        raise


def _publish(store: Any, key: str, kind: str, address: str, seal: Seal) -> None:
    store.set(key, json.dumps({"kind": kind, "address": address, "tag": seal.tag(address)}))


# --- the receiver ---------------------------------------------------------------------------


def receive_routed(
    kind: str,
    store: Any,
    key: str,
    seal: Seal,
    fallback: Callable[[], Transport],
    *,
    into: Any,
    progress: ReceiveProgress | None,
    accept: Any,
    log: Log = logger,
) -> tuple[Any, TransferStats, str]:
    """Receive over the route ``kind`` (socket or mpi), else over ``fallback()``, resuming from
    ``progress``; what ``recv_state`` returns and the route that carried it."""
    from torchpass_slurm.transfer import recv_state

    options: dict[str, Any] = {"into": into, "progress": progress, "accept": accept, "seal": seal}
    try:
        transport = _open_receiver(kind, store, key, seal)
    except TransferError as exc:
        log.warning("no %s route from the donor (%s); receiving over the group", kind, exc)
    else:
        try:
            received, stats = recv_state(transport, timeout=_stall(kind), **options)
            return received, stats, kind
        except TransferError as exc:
            log.warning("the %s transfer failed (%s); receiving the rest over the group", kind, exc)
        finally:
            transport.close()
    received, stats = recv_state(fallback(), timeout=ROUTE_TRANSFER_TIMEOUT, **options)
    return received, stats, GROUP


def _open_receiver(kind: str, store: Any, key: str, seal: Seal) -> Transport:
    """Find the donor's route at ``key`` and connect; TransferError (and the refusal written
    for the donor) when it cannot be taken."""
    try:
        return _connect(kind, store, key, seal)
    except TransferError as exc:
        store.set(f"{key}/refused", str(exc)[:500])
        raise


def _connect(kind: str, store: Any, key: str, seal: Seal) -> Transport:
    try:
        store.wait([key], ROUTE_CONNECT_TIMEOUT)
        doc = json.loads(store.get(key).decode("utf-8", errors="replace"))
        published, address, tag = doc["kind"], doc.get("address", ""), doc.get("tag", "")
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise TransferError(f"the donor published no usable route at {key}: {str(exc)[:200]}") from exc
    if published == "none":
        raise TransferError(f"the donor cannot open a {kind} route: {doc.get('why')}")
    if published != kind or not isinstance(address, str) or not isinstance(tag, str):
        raise TransferError(f"the donor published a {published!r} route at {key}, not {kind!r}")
    if not seal.check_tag(address, tag):
        logger.warning("refused the route at %s: not sealed with the job's key", key)
        raise TransferError(f"the route published at {key} does not carry the job's seal")
    if kind == "socket":
        from torchpass_slurm.transfer import SocketTransport

        host, _, port = address.rpartition(":")
        if not port.isdigit():
            raise TransferError(f"the socket route at {key} is not host:port: {address!r}")
        return SocketTransport.connect_sealed(host, int(port), seal, ROUTE_CONNECT_TIMEOUT)
    from torchpass_slurm.transfer.mpi_process import MPIProcessTransport

    return MPIProcessTransport.connect(address, ROUTE_CONNECT_TIMEOUT)
