"""The job's rendezvous store in a process of its own, beside the supervisor.

torch's TCPStore server runs a thread that calls ``std::terminate`` when it
runs out of file descriptors: about 1,100 idle connections from anyone who
reaches its port used to abort ``tp run`` itself (issue 22). Hosted in a child
process, the store has descriptors of its own (its soft limit raised to the
hard one), and its death is logged in the supervisor's process, which lives
on: the job's control plane, detection and checkpoint restarts do not need
the store. The ranks are given the job's address for it, but torch's server
listens on every interface whatever host it is given (measured: ``*:PORT``),
so it still admits anyone who reaches the port (``docs/security.md``).

The child prints its port on its first line of stdout and then serves until
its stdin closes, so it never outlives the supervisor (even one killed with
SIGKILL: the pipe closes with it)::

    python -m torchpass_slurm.cli.store_host --bind ADDRESS --timeout-s 300
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import subprocess
import sys
import threading
from datetime import timedelta

from torchpass_slurm.errors import ControlPlaneError

__all__ = ["StoreHost", "main"]

logger = logging.getLogger(__name__)

#: How long the supervisor waits for the child to report its port.
READY_TIMEOUT = timedelta(seconds=60)


class StoreHost:
    """A running store process: its address, and whether it still lives."""

    def __init__(self, proc: subprocess.Popen[str], port: int) -> None:
        self.proc, self.port = proc, port
        self._closing = False
        self._watch = threading.Thread(target=self._watch_exit, name="tp-store-watch", daemon=True)
        self._watch.start()

    @classmethod
    def start(cls, bind: str, timeout: timedelta) -> StoreHost | None:
        """Start the store for the address ``bind``; None where torch is not importable (no store)."""
        if importlib.util.find_spec("torch") is None:
            return None
        argv = [sys.executable, "-m", __name__, "--bind", bind, "--timeout-s", str(timeout.total_seconds())]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        line = _first_line(proc, READY_TIMEOUT)
        if not line.strip().isdigit():
            proc.kill()
            proc.wait()
            raise ControlPlaneError(
                f"the rendezvous store did not start on {bind} "
                f"(exit {proc.returncode}, said {line.strip()[:200]!r})",
                hint="its error is in the job's output above",
            )
        port = int(line)
        logger.info("rendezvous store on %s:%d (pid %d)", bind, port, proc.pid)
        return cls(proc, port)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        """Stop the store (idempotent)."""
        self._closing = True
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()  # the child's signal to leave
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _watch_exit(self) -> None:
        code = self.proc.wait()
        if not self._closing:
            logger.error(
                "the rendezvous store (pid %d) ended with status %d: live migration is off for the "
                "rest of the job; lost ranks restart from the checkpoint",
                self.proc.pid,
                code,
            )


def _first_line(proc: subprocess.Popen[str], timeout: timedelta) -> str:
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline() if proc.stdout else ""))
    reader.daemon = True
    reader.start()
    reader.join(timeout.total_seconds())
    return got[0] if got else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="host the job's rendezvous store until stdin closes")
    parser.add_argument(
        "--bind", required=True, help="the job's address (torch's server listens on every interface)"
    )
    parser.add_argument("--timeout-s", type=float, default=300.0, help="the store's wait timeout")
    args = parser.parse_args(argv)
    from torchpass_slurm.control.security import raise_fd_limit
    from torchpass_slurm.rank.rendezvous import make_tcp_store

    raise_fd_limit()
    store = make_tcp_store(args.bind, 0, is_master=True, timeout=timedelta(seconds=args.timeout_s))
    print(store.port, flush=True)
    sys.stdin.read()  # until the supervisor closes the pipe, or dies
    return 0


if __name__ == "__main__":
    sys.exit(main())
