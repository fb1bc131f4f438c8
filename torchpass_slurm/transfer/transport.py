"""The Transport contract: a point-to-point byte pipe to one peer.

Every call takes an explicit ``timedelta`` timeout (as in torchft): nothing in
a transfer waits without a bound. Buffers are contiguous ``torch.uint8``
tensors; ``recv`` fills a preallocated buffer of exactly the expected size (the
stream layer always knows sizes in advance, from its manifest).

``isend``/``irecv`` start an operation and return a :class:`Handle`; the
caller may prepare the next buffer while this one is in flight (the stream
layer double-buffers this way). Operations complete in the order they were
started, per direction. The default implementations are synchronous.

Failure contract (checked by ``tests/unit/transfer/test_contract.py`` for every
implementation):

- a dead peer raises :class:`TransferError` as soon as the transport notices
  (a closed connection), and at the latest when the timeout expires;
- a call that runs past its timeout raises :class:`TransferTimeout`;
- after any error the transport is *broken*: later calls raise
  ``TransferError`` at once. Close it and build a new one (with torch.distributed:
  the next epoch's process group).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

from torchpass_slurm.errors import TransferError, TransferTimeout

if TYPE_CHECKING:
    import torch

__all__ = ["Transport", "AsyncTransport", "Handle", "DoneHandle", "check_buffer", "seconds"]

logger = logging.getLogger(__name__)


def seconds(timeout: timedelta) -> float:
    """``timeout`` in seconds; rejects non-positive and non-timedelta values."""
    if not isinstance(timeout, timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, got {type(timeout).__name__}")
    value = timeout.total_seconds()
    if value <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    return value


def check_buffer(buf: torch.Tensor) -> None:
    """Raise ``TypeError`` unless ``buf`` is a contiguous uint8 tensor."""
    import torch

    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or not buf.is_contiguous():
        kind = f"{buf.dtype} tensor" if isinstance(buf, torch.Tensor) else type(buf).__name__
        raise TypeError(f"a transport buffer must be a contiguous torch.uint8 tensor, got a {kind}")


class Handle(ABC):
    """An operation in flight; ``wait`` blocks until it completed (waiting again returns at once)."""

    @abstractmethod
    def wait(self, timeout: timedelta) -> None:
        """Block until the operation completed; raises TransferError / TransferTimeout."""


class DoneHandle(Handle):
    """A handle of an operation that already completed (synchronous default)."""

    def wait(self, timeout: timedelta) -> None:
        """Returns at once."""


class Transport(ABC):
    """A point-to-point byte pipe to exactly one peer.

    Subclasses implement :meth:`_send`, :meth:`_recv` and :meth:`close`, and
    may override :meth:`_isend` / :meth:`_irecv` for real overlap. The public
    methods check the buffer and the broken state, and mark the transport
    broken when an operation fails.
    """

    #: Name used in logs, benchmark tables and contract-test ids.
    name: str = "transport"

    def __init__(self) -> None:
        self._broken: str | None = None

    # --- public API ---------------------------------------------------------
    def send(self, buf: torch.Tensor, timeout: timedelta) -> None:
        """Send all of ``buf`` (contiguous uint8) to the peer within ``timeout``."""
        self._run("send", buf, timeout, lambda: self._send(buf, timeout))

    def recv(self, buf: torch.Tensor, timeout: timedelta) -> None:
        """Fill all of ``buf`` (contiguous uint8, exactly the expected size) within ``timeout``."""
        self._run("recv", buf, timeout, lambda: self._recv(buf, timeout))

    def isend(self, buf: torch.Tensor, timeout: timedelta) -> Handle:
        """Start sending ``buf``; it must not be modified until the handle's ``wait`` returned."""
        return self._guarded_handle(self._run("isend", buf, timeout, lambda: self._isend(buf, timeout)))

    def irecv(self, buf: torch.Tensor, timeout: timedelta) -> Handle:
        """Start receiving into ``buf``; it is filled once the handle's ``wait`` returned."""
        return self._guarded_handle(self._run("irecv", buf, timeout, lambda: self._irecv(buf, timeout)))

    @property
    def broken(self) -> str | None:
        """Why the transport is unusable, or None while it works."""
        return self._broken

    @abstractmethod
    def close(self) -> None:
        """Release the connection; idempotent. Does not wait for operations in flight."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- for implementations -----------------------------------------------
    @abstractmethod
    def _send(self, buf: torch.Tensor, timeout: timedelta) -> None: ...

    @abstractmethod
    def _recv(self, buf: torch.Tensor, timeout: timedelta) -> None: ...

    def _isend(self, buf: torch.Tensor, timeout: timedelta) -> Handle:
        self._send(buf, timeout)
        return DoneHandle()

    def _irecv(self, buf: torch.Tensor, timeout: timedelta) -> Handle:
        self._recv(buf, timeout)
        return DoneHandle()

    def mark_broken(self, exc: TransferError) -> None:
        """Remember the first failure; later calls raise at once."""
        if self._broken is None:
            self._broken = str(exc).splitlines()[0]
            logger.debug("%s is broken: %s", self.name, self._broken)

    def _run(self, op: str, buf: torch.Tensor, timeout: timedelta, fn: Callable[[], object]) -> object:
        seconds(timeout)
        check_buffer(buf)
        if self._broken is not None:
            raise TransferError(
                f"{self.name}: {op} on a broken transport (earlier failure: {self._broken})",
                hint="close it and build a new transport (a new connection or epoch group)",
            )
        try:
            return fn()
        except TransferError as exc:
            self.mark_broken(exc)
            raise

    def _guarded_handle(self, handle: object) -> Handle:
        assert isinstance(handle, Handle)
        return _GuardedHandle(self, handle)


class AsyncTransport(Transport):
    """A transport whose every operation is started by :meth:`_start` and waited on its handle."""

    @abstractmethod
    def _start(self, op: str, buf: torch.Tensor, timeout: timedelta) -> Handle:
        """Start ``op`` ("send" or "recv") on ``buf``; return its handle."""

    def _send(self, buf: torch.Tensor, timeout: timedelta) -> None:
        self._start("send", buf, timeout).wait(timeout)

    def _recv(self, buf: torch.Tensor, timeout: timedelta) -> None:
        self._start("recv", buf, timeout).wait(timeout)

    def _isend(self, buf: torch.Tensor, timeout: timedelta) -> Handle:
        return self._start("send", buf, timeout)

    def _irecv(self, buf: torch.Tensor, timeout: timedelta) -> Handle:
        return self._start("recv", buf, timeout)


class _GuardedHandle(Handle):
    """Marks the transport broken when the wrapped operation fails."""

    def __init__(self, transport: Transport, inner: Handle) -> None:
        self._transport = transport
        self._inner = inner
        self._done = False

    def wait(self, timeout: timedelta) -> None:
        seconds(timeout)
        if self._done:  # some backends (gloo) would wait for a second completion
            return
        try:
            self._inner.wait(timeout)
        except TransferError as exc:
            self._transport.mark_broken(exc)
            raise
        self._done = True


def timeout_error(name: str, op: str, nbytes: int, timeout: timedelta, detail: str = "") -> TransferTimeout:
    """A uniform TransferTimeout message."""
    extra = f" ({detail})" if detail else ""
    return TransferTimeout(
        f"{name}: {op} of {nbytes} bytes did not complete within {seconds(timeout):g} s{extra}",
        hint="the peer may be dead, stalled or unreachable; rebuild the transport and retry "
        "(with another donor if this one is gone)",
    )
