"""The job's rendezvous store in a process of its own, beside the supervisor.

The store (:class:`~torchpass_slurm.control.store_server.StoreServer`) binds
the job's address only and admits only peers that hold the job's secret
(CURVE with the store's key pair). It still runs in a child of ``tp run``:
its descriptors are its own (its soft limit raised to the hard one), so a
flood of outsiders' connections costs the supervisor nothing, and its death
is logged in the supervisor's process, which lives on: the job's control
plane, detection and checkpoint restarts do not need the store. (torch's
``TCPStore``, which it replaces, listened on every interface, admitted
anyone, and ``std::terminate``-d ``tp run`` at about 1,100 idle connections:
issue 22.)

The child prints its port on its first line of stdout and then serves until
its stdin closes, so it never outlives the supervisor (even one killed with
SIGKILL: the pipe closes with it)::

    python -m torchpass_slurm.supervisor.store_host --bind ADDRESS --secret-file FILE --max-wait-s 300
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

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
    def start(cls, bind: str, secret_file: Path, max_wait: timedelta) -> StoreHost:
        """Start the store on the address ``bind`` for the job whose secret is in ``secret_file``;
        ``max_wait`` bounds how long it parks one rank's get or wait."""
        argv = [
            sys.executable,
            "-m",
            __name__,
            "--bind",
            bind,
            "--secret-file",
            str(secret_file),
            "--max-wait-s",
            str(max_wait.total_seconds()),
        ]
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
        logger.info("rendezvous store on %s:%d (pid %d), job key only", bind, port, proc.pid)
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
    parser.add_argument("--bind", required=True, help="the job's address (the only one it listens on)")
    parser.add_argument("--secret-file", required=True, type=Path, help="the job's secret (tp run's)")
    parser.add_argument("--max-wait-s", type=float, default=300.0, help="the longest a get or wait is parked")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="tp store: %(levelname)s %(message)s")
    from torchpass_slurm.control.secret import load_secret
    from torchpass_slurm.control.store_server import StoreLimits, StoreServer

    limits = StoreLimits(max_wait=timedelta(seconds=args.max_wait_s))
    server = StoreServer(load_secret(args.secret_file), args.bind, limits=limits)
    stop = threading.Event()

    def watch_stdin() -> None:  # the supervisor closes the pipe, or dies
        sys.stdin.read()
        stop.set()

    threading.Thread(target=watch_stdin, name="tp-store-stdin", daemon=True).start()
    print(server.port, flush=True)
    try:
        server.serve(stop)
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
