"""Run one gathering function in a forked child that is killed at the deadline.

A thread cannot be stopped: a device library that hangs in C keeps its thread
forever, and one that stalls while holding the GIL (a C loop that never
releases it) stops the hook's main thread too, past every deadline. A child
process can be killed. So each gathering function (the device source's
``gpus()``, the host facts) runs in a child made with ``fork()``: the child
inherits the source object as it is (an injected fake too), calls it, and
writes the result as JSON to a pipe; the parent waits on the pipe until the
deadline and then SIGKILLs the child. Whatever the library does — hangs, stalls
in Python or C, raises SystemExit at import, segfaults — the parent has an
answer (a value, an error, a timeout) by the deadline.

The child leads a process group of its own, and the parent kills the whole
group: a helper process the library forked dies with it. The child's stdout
and stderr go to ``/dev/null``, so no such helper holds the hook's own output
open after the hook returned (slurmd reads a hook's output to its end).

No pickle crosses the pipe: the child sends ``{"value": ...}`` (the caller's
``encode``) or ``{"error": {"type": ..., "message": ..., "source_error": bool}}``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from torchpass_slurm.errors import SourceError

logger = logging.getLogger(__name__)

__all__ = ["Child", "ChildFailed", "MAX_ANSWER_BYTES"]

T = TypeVar("T")

#: Most bytes a child may answer with (a node's facts are a few KiB).
MAX_ANSWER_BYTES = 4 << 20


class ChildFailed(Exception):
    """The child raised something other than SourceError, or died without an answer.

    ``str()`` is "Type: message" of what the child raised (e.g. "SystemExit: 2").
    """


class Child(Generic[T]):
    """``fn`` running in a forked child; :meth:`result` waits until a deadline, then kills it."""

    def __init__(
        self, fn: Callable[[], T], encode: Callable[[T], Any], decode: Callable[[Any], T], name: str
    ) -> None:
        self.name, self._decode = name, decode
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            os.close(read)
            _child_main(fn, encode, write)
        with contextlib.suppress(OSError):  # the child does the same; whoever is first wins
            os.setpgid(pid, pid)
        os.close(write)
        self.pid, self._read = pid, read
        self._how_it_ended = "still running"

    def result(self, deadline: float, clock: Callable[[], float] = time.monotonic) -> T:
        """The child's value; raises SourceError / ChildFailed as it did, TimeoutError past the deadline."""
        try:
            data = self._read_until(deadline, clock)
        finally:
            os.close(self._read)
            self._reap()
        if data is None:
            raise TimeoutError
        if not data:
            raise ChildFailed(f"{self.name} ended without an answer ({self._how_it_ended})")
        answer = json.loads(data)
        if "value" in answer:
            return self._decode(answer["value"])
        error = answer["error"]
        if error["source_error"]:
            raise SourceError(error["message"], hint=error.get("hint"))
        raise ChildFailed(f"{error['type']}: {error['message']}")

    def _read_until(self, deadline: float, clock: Callable[[], float]) -> bytes | None:
        """Everything the child wrote before it closed the pipe; None when the deadline came first."""
        chunks: list[bytes] = []
        size = 0
        while True:
            left = deadline - clock()
            if left <= 0:
                return None
            ready, _, _ = select.select([self._read], [], [], left)
            if not ready:
                continue
            chunk = os.read(self._read, 1 << 16)
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > MAX_ANSWER_BYTES:
                raise ChildFailed(f"{self.name} answered more than {MAX_ANSWER_BYTES} bytes")
            chunks.append(chunk)

    def _reap(self) -> None:
        """Kill the child's group (the child and what it forked) and collect the child's status
        without waiting for it. The child is not reaped yet, so its group id is still its own."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        # A child stuck in the kernel (a hung NFS stat) dies only when the call returns:
        # give it a moment, then leave it to init rather than wait.
        for _ in range(20):
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self._how_it_ended = _describe(status)
                return
            time.sleep(0.005)
        logger.debug("%s (pid %d) did not die at once; not waiting for it", self.name, self.pid)


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"killed by signal {sig} ({signal.Signals(sig).name})"
    return f"exit status {os.WEXITSTATUS(status)}"


def _detach_output() -> None:
    """Point fds 1 and 2 at /dev/null: what this child forks cannot hold the hook's output."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)


def _child_main(fn: Callable[[], Any], encode: Callable[[Any], Any], write: int) -> None:
    """In the child: call ``fn``, write the answer, and leave without running any cleanup of the parent's."""
    code = 0
    try:
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
        _detach_output()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        answer: dict[str, Any] = {"value": encode(fn())}
    # Deliberately everything: SystemExit from a library, KeyboardInterrupt, a bug;
    # each is an answer for the parent to judge, never this process's exit status.
    except BaseException as err:
        answer = {
            "error": {
                "type": type(err).__name__,
                "message": err.message if isinstance(err, SourceError) else str(err),
                "hint": err.hint if isinstance(err, SourceError) else None,
                "source_error": isinstance(err, SourceError),
            }
        }
    try:
        data = json.dumps(answer).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(write, view) :]
    except BaseException:
        code = 1
    os._exit(code)
