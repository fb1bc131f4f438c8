"""A rank's connection to the job's rendezvous store: a torch ``Store`` over CURVE.

:class:`JobStore` is a ``torch.distributed.Store`` written in Python, so
``init_process_group(store=PrefixStore("epoch3", job_store))`` builds gloo's
(or NCCL's) group through it exactly as through torch's ``TCPStore``. It
talks to the store that ``tp run`` hosts (:mod:`~torchpass_slurm.control.store_server`)
with the job's store key pair, derived from the job's secret: a process
without the secret can neither read nor write a key, and the wire format is
:mod:`~torchpass_slurm.control.store_wire` (frames, never pickle).

Thread-safe: each thread that uses the store gets a DEALER socket of its own
(gloo may call the store from its own threads). A request that gets no
answer within its timeout raises ``DistStoreError`` (a ``RuntimeError``), as
torch's stores do, and that thread's socket is replaced, so a late answer is
never taken for the next request's. A forked child (a data loader worker)
gets fresh sockets too.

The store owns its sockets and closes them before its ZeroMQ context, when
:meth:`JobStore.close` is called or when the store is collected. A context left
to the garbage collector with a socket still open is a deadlock: the
collector clears the context's weak references to its sockets before it
calls the context's ``__del__``, whose ``term()`` then waits for sockets that
it can no longer close, with the collection itself stuck for good (no more
automatic collection in the process, and the thread that ran it hangs).

Keep a reference to a JobStore for as long as torch uses it: a ``PrefixStore``
or a process group built on it holds torch's C++ side only, and once the Python
object is collected their calls fail ("Not implemented"). The rank keeps its
one client for the process's life (``EpochRendezvous.store``).

Imported only where a group is built: it imports torch.
"""

from __future__ import annotations

import datetime
import itertools
import os
import threading
import time
import weakref
from collections.abc import Iterable

import torch.distributed as dist
import zmq

from torchpass_slurm.control.client import HWM, timeout_ms
from torchpass_slurm.control.security import apply_limits, derive_keys, make_curve_client
from torchpass_slurm.control.store_wire import (
    ERROR,
    MAX_VALUE_BYTES,
    OK,
    TIMEOUT,
    Op,
    encode_int,
    parse_int,
)

__all__ = ["JobStore", "StoreUnavailable", "REPLY_SLACK"]

#: How much longer than a request's own wait a rank waits for the store's answer.
REPLY_SLACK = datetime.timedelta(seconds=5)

StoreUnavailable: type[RuntimeError] = getattr(dist, "DistStoreError", RuntimeError)


class JobStore(dist.Store):
    """The job's store at ``host:port``, reached with the job's ``secret``; ``timeout`` bounds
    every wait (a get of a key not set yet, a wait), as torch's ``Store.timeout`` does, and an
    answer is awaited ``reply_slack`` longer than the request's own wait."""

    def __init__(
        self,
        host: str,
        port: int,
        secret: bytes,
        timeout: datetime.timedelta,
        *,
        reply_slack: datetime.timedelta = REPLY_SLACK,
    ) -> None:
        super().__init__()
        self.reply_slack = reply_slack
        self._timeout = timeout
        super().set_timeout(timeout)
        bracketed = f"[{host}]" if ":" in host and not host.startswith("[") else host
        self.endpoint = f"tcp://{bracketed}:{port}"
        self._keys = derive_keys(secret, plane="store")
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._pid = -1
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sockets: list[zmq.Socket[bytes]] = []  # every thread's, held here so that close() reaches them
        self._local = threading.local()

    # -- torch's Store interface -------------------------------------------------------------
    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout
        super().set_timeout(timeout)

    def set(self, key: str, value: bytes | str) -> None:
        self._call(Op.SET, _b(key), _b(value))

    def get(self, key: str) -> bytes:
        return self._call(Op.GET, _b(key), self._wait_ms(None), wait=self._timeout)[0]

    def add(self, key: str, amount: int) -> int:
        return parse_int(self._call(Op.ADD, _b(key), encode_int(int(amount)))[0])

    def wait(self, keys: Iterable[str], timeout: datetime.timedelta | None = None) -> None:
        self._call(Op.WAIT, self._wait_ms(timeout), *(_b(k) for k in keys), wait=timeout or self._timeout)

    def check(self, keys: Iterable[str]) -> bool:
        return self._call(Op.CHECK, *(_b(k) for k in keys))[0] == b"1"

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._call(Op.COMPARE_SET, _b(key), _b(expected), _b(desired))[0]

    def delete_key(self, key: str) -> bool:
        return self._call(Op.DELETE, _b(key))[0] == b"1"

    def num_keys(self) -> int:
        return parse_int(self._call(Op.NUM_KEYS)[0])

    def close(self) -> None:
        """Close every socket of this process (the store object is unusable afterwards)."""
        with self._lock:
            ctx, self._ctx = self._ctx, None
            sockets, self._sockets = self._sockets, []
        if ctx is not None:
            _release(ctx, sockets, self._pid)

    # -- one request ---------------------------------------------------------------------------
    def _call(self, op: Op, *args: bytes, wait: datetime.timedelta | None = None) -> list[bytes]:
        sock = self._socket()
        request_id = next(self._ids).to_bytes(8, "big")
        sock.send_multipart([request_id, op.value, *args])
        limit = (wait or datetime.timedelta(0)) + self.reply_slack
        deadline = time.monotonic() + limit.total_seconds()
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(timeout_ms(datetime.timedelta(seconds=left))):
                self._drop_socket()
                raise StoreUnavailable(
                    f"the job's store at {self.endpoint} did not answer a {op.name.lower()} within "
                    f"{limit} (is tp run alive, and is this the job's secret?)"
                )
            frames = sock.recv_multipart()
            if len(frames) >= 2 and frames[0] == request_id:
                break  # anything else answers an earlier request that timed out
        status, payload = frames[1], frames[2:]
        if status == OK and (payload or op not in _WITH_PAYLOAD):
            return payload
        text = b"".join(payload[:1]).decode("utf-8", "replace")[:300]
        if status == TIMEOUT:
            raise StoreUnavailable(f"{op.name.lower()} on the job's store timed out after {wait}: {text}")
        what = "refused" if status == ERROR else f"answered {status[:16]!r} to"
        raise StoreUnavailable(f"the job's store {what} a {op.name.lower()}: {text}")

    def _wait_ms(self, timeout: datetime.timedelta | None) -> bytes:
        return encode_int(timeout_ms(timeout or self._timeout))

    def _socket(self) -> zmq.Socket[bytes]:
        with self._lock:
            if self._pid != os.getpid():  # first use, or a forked child: the parent's are not ours
                self._pid, self._ctx, self._local = os.getpid(), zmq.Context(), threading.local()
                self._sockets = []
                weakref.finalize(self, _release, self._ctx, self._sockets, self._pid)
            ctx, sockets = self._ctx, self._sockets
        if ctx is None:
            raise StoreUnavailable(f"the connection to the job's store at {self.endpoint} is closed")
        sock: zmq.Socket[bytes] | None = getattr(self._local, "sock", None)
        if sock is None:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, HWM)
            sock.setsockopt(zmq.RCVHWM, HWM)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_VALUE_BYTES + (64 << 10))
            apply_limits(sock)
            make_curve_client(sock, self._keys)
            sock.connect(self.endpoint)
            self._local.sock = sock
            with self._lock:
                sockets.append(sock)
        return sock

    def _drop_socket(self) -> None:
        sock = getattr(self._local, "sock", None)
        self._local.sock = None
        if sock is not None:
            with self._lock:
                if sock in self._sockets:
                    self._sockets.remove(sock)
            sock.close(linger=0)


def _release(ctx: zmq.Context[zmq.Socket[bytes]], sockets: list[zmq.Socket[bytes]], owner: int) -> None:
    """Close ``sockets``, then ``ctx``, in the process that made them (a forked child leaves
    its parent's alone: they are not its to close)."""
    if os.getpid() != owner:
        return
    for sock in sockets:
        sock.close(linger=0)
    sockets.clear()
    if not ctx.closed:
        ctx.term()


_WITH_PAYLOAD = {Op.GET, Op.ADD, Op.CHECK, Op.COMPARE_SET, Op.DELETE, Op.NUM_KEYS}


def _b(value: bytes | str | bytearray | memoryview) -> bytes:
    return value.encode("utf-8") if isinstance(value, str) else bytes(value)
