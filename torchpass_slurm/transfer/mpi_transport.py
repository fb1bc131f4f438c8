"""MPITransport: mpi4py point-to-point on an (inter)communicator.

mpi4py is imported lazily (``pip install mpi4py mpich``; the main venv does
not need it). A donor and a spare live in different Slurm steps, so they are
not in one MPI world: they meet with ``MPI.Open_port``/``Comm.Accept`` on one
side and ``Comm.Connect`` on the other, which gives an intercommunicator where
the peer is rank 0 of the remote group. What works where (see
docs/design/transfer.md): MPICH 5 wheels across two ``srun --mpi=pmi2`` steps
and across two ``mpiexec -n 1`` launches, a singleton accepting from an
``mpiexec``-launched peer; two MPICH *singletons* cannot connect ("Local and
remote groups ... must not contain the same processes"); Open MPI under Slurm's
PMIx plugin cannot connect at all (MPI_ERR_INTERN).

A live migration does not use this class: with ``TORCHPASS_TRANSPORT=mpi`` each
end's MPI runs in a helper process (:mod:`.mpi_process`), because a rank's torch
may link another MPI (Debian's links Open MPI) and an MPI call here cannot be
interrupted. This in-process transport serves the contract tests and the
transfer benchmark's in-rank rows.

Timeouts: MPI has none, so every operation is a non-blocking ``Isend``/``Irecv``
polled with ``Test`` until its deadline (polling also drives MPICH's progress
engine). On timeout the request stays posted and the transport is broken.
``Accept``/``Connect`` are blocking MPI calls: they run on a helper thread that
is abandoned (not killed) when the timeout expires. Whether a dead peer is
noticed before the timeout depends on the MPI library (MPICH over UCX/TCP
usually reports it; otherwise the timeout fires).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from torchpass_slurm.errors import TransferError
from torchpass_slurm.transfer.transport import AsyncTransport, Handle, seconds, timeout_error

if TYPE_CHECKING:
    import torch

__all__ = ["MPITransport", "mpi_problem"]

logger = logging.getLogger(__name__)

DEFAULT_TAG = 7077
#: How long :meth:`MPITransport.close` waits for the peer's side of ``Disconnect``.
DISCONNECT_TIMEOUT = timedelta(seconds=10)
#: How often a bounded blocking call (:func:`_blocking_within`) asks whether to give up.
CANCEL_POLL_S = 0.5


def mpi_problem() -> str | None:
    """Why mpi4py cannot be used here, or None when it can."""
    try:
        from mpi4py import MPI  # noqa: F401
    except ImportError as exc:
        return f"mpi4py is not importable ({exc}); pip install mpi4py mpich"
    # Deliberately broad: MPI_Init runs at this import and fails in the MPI library's own
    # way (RuntimeError for a missing libmpi, MPI.Exception, ...); saying why is this function's job.
    except Exception as exc:
        return f"MPI failed to initialize: {type(exc).__name__}: {exc}"
    return None


def _mpi() -> Any:
    from mpi4py import MPI

    return MPI


class _RequestHandle(Handle):
    def __init__(self, transport: MPITransport, request: Any, op: str, nbytes: int) -> None:
        self._transport, self._request, self._op, self._nbytes = transport, request, op, nbytes

    def wait(self, timeout: timedelta) -> None:
        MPI = _mpi()
        deadline = time.monotonic() + seconds(timeout)
        status = MPI.Status()
        pause = 0.0
        try:
            while not self._request.Test(status):
                if time.monotonic() >= deadline:
                    raise timeout_error(self._transport.name, self._op, self._nbytes, timeout)
                time.sleep(pause)
                pause = min(pause * 2 or 20e-6, 1e-3)
        except MPI.Exception as exc:
            raise self._transport.failed(self._op, self._nbytes, exc) from exc
        if self._op == "recv" and status.Get_count(MPI.BYTE) != self._nbytes:
            raise TransferError(
                f"{self._transport.name}: expected a {self._nbytes}-byte message, "
                f"got {status.Get_count(MPI.BYTE)} bytes"
            )


class MPITransport(AsyncTransport):
    """Point-to-point over an mpi4py communicator (an intercommunicator from Accept/Connect)."""

    name = "mpi"

    def __init__(self, comm: Any, peer: int = 0, *, tag: int = DEFAULT_TAG) -> None:
        super().__init__()
        MPI = _mpi()
        self.comm = comm
        self.peer = int(peer)
        self.tag = int(tag)
        comm.Set_errhandler(MPI.ERRORS_RETURN)

    @classmethod
    def accept(
        cls,
        publish: Callable[[str], None],
        timeout: timedelta,
        cancelled: Callable[[], str | None] | None = None,
    ) -> MPITransport:
        """Open a port, hand its name to ``publish`` (a file, the control plane), accept one peer.
        ``cancelled`` is asked about twice a second while waiting: a reason (the peer said it
        will not come) ends the wait early with a TransferError."""
        MPI = _mpi()
        port = MPI.Open_port()
        publish(port)
        try:
            comm = _blocking_within(lambda: MPI.COMM_SELF.Accept(port), timeout, "accept", cancelled)
        finally:
            MPI.Close_port(port)
        return cls(comm, 0)

    @classmethod
    def connect(cls, port_name: str, timeout: timedelta) -> MPITransport:
        """Connect to a port opened by :meth:`accept` on the peer."""
        MPI = _mpi()
        comm = _blocking_within(lambda: MPI.COMM_SELF.Connect(port_name), timeout, "connect")
        return cls(comm, 0)

    def failed(self, op: str, nbytes: int, exc: BaseException) -> TransferError:
        """A TransferError for an MPI failure."""
        first = str(exc).splitlines()[0]
        return TransferError(
            f"{self.name}: {op} of {nbytes} bytes with peer {self.peer} failed: {first}",
            hint="the peer is probably gone; connect to another donor and retry",
        )

    def _start(self, op: str, buf: torch.Tensor, timeout: timedelta) -> Handle:
        MPI = _mpi()
        if buf.device.type != "cpu":
            raise TypeError(f"MPITransport needs CPU buffers, got one on {buf.device}")
        spec = [buf.numpy(), MPI.BYTE]
        try:
            if op == "send":
                request = self.comm.Isend(spec, dest=self.peer, tag=self.tag)
            else:
                request = self.comm.Irecv(spec, source=self.peer, tag=self.tag)
        except MPI.Exception as exc:
            raise self.failed(op, buf.numel(), exc) from exc
        return _RequestHandle(self, request, op, buf.numel())

    def close(self, timeout: timedelta = DISCONNECT_TIMEOUT) -> None:
        """Disconnect from a healthy peer; a broken communicator is only dropped (Disconnect could
        hang). Disconnect is collective: a peer that died after the last message would hold it
        forever, so it runs on an abandoned helper thread, bounded by ``timeout``."""
        comm, self.comm = self.comm, None
        if comm is None or self.broken is not None:
            return
        try:
            _blocking_within(comm.Disconnect, timeout, "disconnect")
        except TransferError as exc:
            logger.debug("MPI Disconnect did not complete: %s", exc)


def _blocking_within(
    call: Callable[[], Any],
    timeout: timedelta,
    what: str,
    cancelled: Callable[[], str | None] | None = None,
) -> Any:
    """Run a blocking MPI call on a helper thread; TransferTimeout if it does not return in time,
    a TransferError as soon as ``cancelled`` (asked every :data:`CANCEL_POLL_S`) gives a reason.

    An MPI error becomes a TransferError; anything else the call raised is raised as it is.
    """
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = call()
        except BaseException as exc:  # handed to the caller below, never lost in the thread
            result["error"] = exc

    thread = threading.Thread(target=run, name=f"tp-mpi-{what}", daemon=True)
    thread.start()
    deadline = time.monotonic() + seconds(timeout)
    step = CANCEL_POLL_S if cancelled is not None else seconds(timeout)
    while thread.is_alive() and (left := deadline - time.monotonic()) > 0:
        thread.join(min(step, left))
        why = cancelled() if cancelled is not None and thread.is_alive() else None
        if why:
            raise TransferError(f"mpi: {what} given up: {why}; the MPI call is abandoned")
    if thread.is_alive():
        raise timeout_error("mpi", what, 0, timeout, "the peer did not show up; the MPI call is abandoned")
    error = result.get("error")
    if isinstance(error, _mpi().Exception):
        raise TransferError(
            f"mpi: {what} failed: {(str(error) or type(error).__name__).splitlines()[0]}"
        ) from error
    if error is not None:
        raise error
    return result["value"]
