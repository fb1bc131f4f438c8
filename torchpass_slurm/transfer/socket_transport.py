"""SocketTransport: plain TCP, the simplest transport and the raw-TCP baseline.

The socket is non-blocking; every call loops ``send``/``recv_into`` on the
tensor's memory (through its numpy view, no copy) and waits for readiness with
``poll`` against a deadline, so a call's ``timeout`` bounds the whole call.
``isend``/``irecv`` run on one worker thread per direction (a ``send`` is an
``isend`` waited on), so operations stay ordered and the caller's thread is
free to checksum the next chunk meanwhile: ``socket.send`` and ``hashlib``
both release the GIL.

A peer that dies closes its end: the next read sees EOF (or ``ECONNRESET``)
and raises :class:`TransferError` at once.

:meth:`SocketListener.accept_sealed` and :meth:`SocketTransport.connect_sealed`
admit only a peer that holds a transfer's :class:`~torchpass_slurm.transfer.seal.Seal`:
the listener sends every connection a fresh challenge and keeps the first that
answers it right. Up to :data:`MAX_PENDING` connections are judged at once,
each for at most :data:`HANDSHAKE_TIMEOUT`, so silent or wrong peers neither
hold the listener nor exhaust it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import secrets
import select
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import TYPE_CHECKING

from torchpass_slurm.errors import TransferError
from torchpass_slurm.transfer.seal import CHALLENGE_BYTES
from torchpass_slurm.transfer.transport import AsyncTransport, Handle, seconds, timeout_error

if TYPE_CHECKING:
    import torch

    from torchpass_slurm.transfer.seal import Seal

__all__ = ["SocketTransport", "SocketListener", "SOCKET_BUFFER_BYTES", "HANDSHAKE_TIMEOUT", "MAX_PENDING"]

logger = logging.getLogger(__name__)

#: SO_SNDBUF / SO_RCVBUF asked for (the kernel caps it at net.core.[rw]mem_max).
SOCKET_BUFFER_BYTES = 4 << 20
#: A connection to a sealed listener that has not answered its challenge by then is closed.
HANDSHAKE_TIMEOUT = timedelta(seconds=5)
#: Connections a sealed listener judges at once; past this the oldest is closed.
MAX_PENDING = 16


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _connect_tuned(host: str, port: int, timeout_s: float) -> socket.socket:
    """Connect with the buffer sizes set *before* the handshake (TCP window scaling)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        _tune(sock)
        sock.settimeout(timeout_s)
        sock.connect(addr)
    except BaseException:  # close the socket on any failure, then re-raise it unchanged
        sock.close()
        raise
    return sock


class _FutureHandle(Handle):
    def __init__(self, future: Future[None], name: str, op: str, nbytes: int) -> None:
        self._future = future
        self._name, self._op, self._nbytes = name, op, nbytes

    def wait(self, timeout: timedelta) -> None:
        try:
            self._future.result(timeout=seconds(timeout))
        except FutureTimeout:
            raise timeout_error(self._name, self._op, self._nbytes, timeout) from None


class SocketTransport(AsyncTransport):
    """A TCP connection to one peer (or any connected stream socket, e.g. a socketpair)."""

    name = "socket"

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        _tune(sock)
        sock.setblocking(False)
        self.sock = sock
        self._workers = {op: ThreadPoolExecutor(1, thread_name_prefix=f"tp-{op}") for op in ("send", "recv")}
        self._closed = False

    # --- construction -----------------------------------------------------------
    @classmethod
    def listener(cls, host: str = "0.0.0.0", port: int = 0) -> SocketListener:
        """Bind and listen; ``.port`` tells the chosen port, ``.accept(timeout)`` gives a transport."""
        return SocketListener(host, port)

    @classmethod
    def listen(cls, host: str, port: int, timeout: timedelta) -> SocketTransport:
        """Listen on ``host:port`` and accept exactly one peer within ``timeout``."""
        with SocketListener(host, port) as listener:
            return listener.accept(timeout)

    @classmethod
    def connect_sealed(cls, host: str, port: int, seal: Seal, timeout: timedelta) -> SocketTransport:
        """Connect to a sealed listener and answer its challenge (:meth:`SocketListener.accept_sealed`)."""
        import torch

        transport = cls.connect(host, port, timeout)
        try:
            challenge = torch.empty(CHALLENGE_BYTES, dtype=torch.uint8)
            transport.recv(challenge, min(timeout, HANDSHAKE_TIMEOUT))
            answer = seal.answer(bytes(challenge.numpy()))
            transport.send(torch.frombuffer(bytearray(answer), dtype=torch.uint8), HANDSHAKE_TIMEOUT)
        except BaseException:
            transport.close()
            raise
        return transport

    @classmethod
    def connect(cls, host: str, port: int, timeout: timedelta) -> SocketTransport:
        """Connect to a listening peer, retrying refused connections until ``timeout``."""
        deadline = time.monotonic() + seconds(timeout)
        while True:
            remaining = deadline - time.monotonic()
            try:
                return cls(_connect_tuned(host, port, max(remaining, 0.01)))
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise TransferError(
                        f"socket: could not connect to {host}:{port} within {seconds(timeout):g} s: {exc}",
                        hint="is the peer listening on that address?",
                    ) from exc
                time.sleep(min(0.05, max(remaining, 0)))

    # --- I/O ---------------------------------------------------------------------
    def _io(self, op: str, buf: torch.Tensor, timeout: timedelta) -> None:
        if buf.device.type != "cpu":
            raise TypeError(f"SocketTransport needs CPU buffers, got one on {buf.device}")
        view = buf.numpy().data.cast("B")
        deadline = time.monotonic() + seconds(timeout)
        poller = select.poll()
        poller.register(self.sock, select.POLLOUT if op == "send" else select.POLLIN)
        done, total = 0, len(view)
        while done < total:
            try:
                n = self.sock.send(view[done:]) if op == "send" else self.sock.recv_into(view[done:])
            except (BlockingIOError, InterruptedError):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise timeout_error(self.name, op, total, timeout, f"{done} bytes done") from None
                poller.poll(remaining * 1000)
                continue
            except OSError as exc:
                if self._closed and exc.errno in (errno.EBADF, None):
                    raise TransferError(f"{self.name}: {op} aborted, the transport was closed") from exc
                raise TransferError(
                    f"{self.name}: {op} failed after {done} of {total} bytes: {exc}",
                    hint="the peer is probably gone; retry with another donor",
                ) from exc
            if n == 0:
                raise TransferError(
                    f"{self.name}: the peer closed the connection after {done} of {total} bytes of a {op}",
                    hint="the peer is probably gone; retry with another donor",
                )
            done += n

    def _start(self, op: str, buf: torch.Tensor, timeout: timedelta) -> Handle:
        if self._closed:
            raise TransferError(f"{self.name}: {op} on a closed transport")
        future = self._workers[op].submit(self._io, op, buf, timeout)
        return _FutureHandle(future, self.name, op, buf.numel())

    def close(self) -> None:
        """Close the socket; operations in flight fail with TransferError."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        for worker in self._workers.values():
            worker.shutdown(wait=False)


class _Pending:
    """A connection to a sealed listener, waiting for its answer."""

    def __init__(self, conn: socket.socket, addr: str, challenge: bytes) -> None:
        self.conn, self.addr, self.challenge = conn, addr, challenge
        self.answer = bytearray()
        self.expires = time.monotonic() + seconds(HANDSHAKE_TIMEOUT)

    def read(self) -> bool:
        """Read what arrived; True once the answer is complete (or the peer hung up: answer short)."""
        try:
            data = self.conn.recv(CHALLENGE_BYTES - len(self.answer))
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True
        self.answer += data
        return not data or len(self.answer) == CHALLENGE_BYTES


class SocketListener:
    """A listening TCP socket that hands out one :class:`SocketTransport` per accepted peer."""

    def __init__(self, host: str = "0.0.0.0", port: int = 0) -> None:
        self.sock = socket.create_server((host, port), backlog=8)
        _tune(self.sock)  # accepted sockets inherit the buffer sizes
        self.host = host
        self.port: int = self.sock.getsockname()[1]

    def accept(self, timeout: timedelta) -> SocketTransport:
        """Wait up to ``timeout`` for one peer to connect."""
        self.sock.settimeout(seconds(timeout))
        try:
            conn, addr = self.sock.accept()
        except TimeoutError:
            raise timeout_error(
                "socket", "accept", 0, timeout, f"nobody connected to port {self.port}"
            ) from None
        logger.debug("accepted a transfer connection from %s:%s", *addr[:2])
        return SocketTransport(conn)

    def accept_sealed(self, seal: Seal, timeout: timedelta) -> SocketTransport:
        """The first peer within ``timeout`` that answers its challenge with ``seal``'s key.

        Every other connection is closed: one that answers wrong at once, a silent one
        after :data:`HANDSHAKE_TIMEOUT`, the oldest when :data:`MAX_PENDING` are pending.
        """
        deadline = time.monotonic() + seconds(timeout)
        pending: dict[socket.socket, _Pending] = {}
        self.sock.setblocking(False)
        try:
            while (left := deadline - time.monotonic()) > 0:
                now = time.monotonic()
                for conn in [c for c, p in pending.items() if p.expires <= now]:
                    self._refuse(pending.pop(conn), "did not answer its challenge in time")
                wake = min([p.expires for p in pending.values()] + [deadline]) - now
                readable, _, _ = select.select([self.sock, *pending], [], [], max(min(wake, left), 0.001))
                for conn in readable:
                    if conn is self.sock:
                        self._admit(pending)
                        continue
                    peer = pending[conn]
                    if not peer.read():
                        continue
                    del pending[conn]
                    if seal.check_answer(peer.challenge, bytes(peer.answer)):
                        logger.debug("admitted a sealed transfer peer from %s", peer.addr)
                        return SocketTransport(conn)
                    self._refuse(peer, "answered its challenge without the job's key")
            why = f"no peer with the transfer's key connected to port {self.port}"
            raise timeout_error("socket", "accept", 0, timeout, why)
        finally:
            for peer in pending.values():
                peer.conn.close()

    def _admit(self, pending: dict[socket.socket, _Pending]) -> None:
        try:
            conn, addr = self.sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        if len(pending) >= MAX_PENDING:
            oldest = min(pending.values(), key=lambda p: p.expires)
            self._refuse(pending.pop(oldest.conn), f"pushed out: {MAX_PENDING} connections pending")
        peer = _Pending(conn, f"{addr[0]}:{addr[1]}", secrets.token_bytes(CHALLENGE_BYTES))
        try:
            conn.setblocking(False)
            conn.send(peer.challenge)  # 16 bytes into an empty send buffer: never blocks
        except OSError:
            conn.close()
            return
        pending[conn] = peer

    @staticmethod
    def _refuse(peer: _Pending, why: str) -> None:
        logger.warning("refused a transfer connection from %s: it %s", peer.addr, why)
        peer.conn.close()

    def close(self) -> None:
        """Stop listening."""
        self.sock.close()

    def __enter__(self) -> SocketListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
