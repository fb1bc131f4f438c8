"""MPIProcessTransport: MPI moves the bytes in a helper process that the rank can kill.

The rank never imports mpi4py. Each transport starts :mod:`.mpi_helper` (a standalone script,
run by path) as ``mpiexec -n 1`` of MPICH's hydra on this node, talks to it over an AF_UNIX
socket pair whose helper end the helper inherits, and forwards every operation of the stream
to it; the helper meets the peer's helper with ``Open_port``/``Accept`` or ``Connect`` and
moves the bytes with ``Isend``/``Irecv``. Why a process (docs/design/transfer.md, "MPI"): two
MPI libraries cannot share a process (Debian trixie's torch loads Open MPI; the helper runs
the MPICH wheel), and an MPI call cannot be interrupted, only its process killed.

The launch (:class:`HelperLaunch`)::

    mpiexec.hydra -launcher fork -rmk user -hosts <this node> -n 1 <python> <mpi_helper.py> FD

``-launcher fork -rmk user``: inside a Slurm step hydra would read the allocation and start
its proxy with ``srun``; these keep it on this node, forked. ``-hosts <this node>``: the
node's own name, which hydra hands to MPICH as its host name (the default outside Slurm too;
``localhost`` would give every node's helper the same one). mpiexec is ``mpiexec.hydra``
next to this Python (a venv with the mpich wheel), else on PATH: only MPICH's hydra has that
name (Debian's ``mpiexec`` may be Open MPI's). The helper's environment (:func:`helper_env`)
drops the step's PMI variables (``PMI*``: Slurm's pmi2 and PMIx; ``HYDI_``: an outer hydra),
and its mpi4py loads the MPICH of that hydra: ``MPI4PY_LIBMPI=<prefix>/lib/libmpi.so.12``
when the library is there (mpi4py then finds the ABI from it), else ``MPI4PY_MPIABI=mpich``
(the dynamic linker finds ``libmpi.so.12``). A job's own MPI4PY_* settings are for its own MPI
and do not reach the helper.

Failures: the helper's exit is an EOF on the socket, a TransferError at once with the tail of
its output; every wait is a socket timeout of the rank (a dead *remote* peer is still only
seen by the timeout: MPICH does not report it). A failed operation, :meth:`close` and every
error path stop the helper (:meth:`_Helper.stop`): SIGKILL to it, then hydra's own teardown
(SIGTERM to mpiexec), then SIGKILL to mpiexec's group, each bounded by :data:`KILL_GRACE`,
and mpiexec is reaped. No thread is started in the rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import IO, TYPE_CHECKING

from torchpass_slurm.errors import TransferError
from torchpass_slurm.transfer import mpi_helper as wire
from torchpass_slurm.transfer.mpi_helper import Code
from torchpass_slurm.transfer.transport import AsyncTransport, Handle, seconds, timeout_error

if TYPE_CHECKING:
    import torch

__all__ = ["MPIProcessTransport", "HelperLaunch", "helper_env", "DISCONNECT_TIMEOUT", "KILL_GRACE"]

logger = logging.getLogger(__name__)

#: The helper script, run by path.
HELPER_SCRIPT = Path(__file__).with_name("mpi_helper.py")
#: hydra's options: on this node, forked, whatever the environment says about Slurm.
HYDRA_OPTIONS = ("-launcher", "fork", "-rmk", "user")
#: Variables of the rank's own launcher that must not reach the helper's MPI.
LAUNCHER_VARIABLES = ("PMI", "HYDI_")
#: How long :meth:`MPIProcessTransport.close` waits for a healthy peer's side of ``Disconnect``.
DISCONNECT_TIMEOUT = timedelta(seconds=10)
#: How long each step of stopping the helper waits for the processes to be gone.
KILL_GRACE = timedelta(seconds=1)
#: How often a wait to meet the peer asks whether to give up.
CANCEL_POLL_S = 0.5
#: How much of the helper's output a TransferError quotes.
STDERR_TAIL_CHARS = 600


def find_hydra() -> str | None:
    """MPICH's ``mpiexec.hydra`` next to this Python, else on PATH; None when there is none."""
    return shutil.which("mpiexec.hydra", path=os.path.dirname(sys.executable)) or shutil.which(
        "mpiexec.hydra"
    )


def helper_env(environ: Mapping[str, str], libmpi: str | None) -> dict[str, str]:
    """The helper's environment: the rank's, without its launcher's PMI, loading ``libmpi``
    (MPICH's library of the hydra that starts it; None: found by soname)."""
    env = {k: v for k, v in environ.items() if not k.startswith(LAUNCHER_VARIABLES)}
    env.pop("MPI4PY_LIBMPI", None)
    env.pop("MPI4PY_MPIABI", None)
    if libmpi is not None:
        env["MPI4PY_LIBMPI"] = libmpi
    else:
        env["MPI4PY_MPIABI"] = "mpich"
    return env


@dataclass(frozen=True)
class HelperLaunch:
    """How a helper is started (module docstring): hydra, the Python, the script, the node."""

    hydra: str
    python: str = sys.executable
    script: str = str(HELPER_SCRIPT)
    host: str = field(default_factory=socket.gethostname)

    @classmethod
    def find(cls) -> HelperLaunch:
        """This node's launch; TransferError when there is no MPICH hydra."""
        hydra = find_hydra()
        if hydra is None:
            raise TransferError(
                "mpi: no MPICH mpiexec.hydra next to this Python or on PATH",
                hint="pip install mpich mpi4py in the ranks' environment, or use another transport",
            )
        return cls(hydra)

    def argv(self, fd: int) -> list[str]:
        """The command line, with ``fd`` the helper's end of the socket pair."""
        return [self.hydra, *HYDRA_OPTIONS, "-hosts", self.host, "-n", "1", self.python, self.script, str(fd)]

    def libmpi(self) -> str | None:
        """``<prefix>/lib/libmpi.so.12`` of the hydra at ``<prefix>/bin``, when it is there."""
        lib = Path(os.path.realpath(self.hydra)).parent.parent / "lib" / "libmpi.so.12"
        return str(lib) if lib.is_file() else None


class _Deadline:
    """The end of one wait, and the timeout it came from (for the message)."""

    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout
        self.at = time.monotonic() + seconds(timeout)

    def left(self) -> float:
        return self.at - time.monotonic()


class _Helper:
    """One helper process and the rank's end of its socket: messages both ways, and its end."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket, log: IO[bytes]) -> None:
        self.proc, self.sock, self.log = proc, sock, log
        self.pid: int | None = None  # the helper's own pid (HELLO), below hydra's proxy
        self.pidfd: int | None = None
        self.tail = ""  # the end of its output, once stopped

    @classmethod
    def launch(cls, launch: HelperLaunch, deadline: _Deadline) -> _Helper:
        """Start a helper and wait (until ``deadline``) for its MPI to be up."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        log = tempfile.TemporaryFile(prefix="tp-mpi-helper-")  # noqa: SIM115 (closed by stop())
        try:
            proc = subprocess.Popen(
                launch.argv(theirs.fileno()),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=helper_env(os.environ, launch.libmpi()),
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )
        except OSError as exc:
            mine.close()
            log.close()
            raise TransferError(
                f"mpi: cannot start the MPI helper with {launch.hydra}: {exc}",
                hint="check the MPICH installation (pip install mpich mpi4py) or use another transport",
            ) from exc
        finally:
            theirs.close()
        helper = cls(proc, mine, log)
        try:
            (pid,) = struct.unpack("<Q", helper.expect(Code.HELLO, deadline, "start the helper"))
            helper.adopt(pid)
            library = helper.expect(Code.READY, deadline, "start MPI").decode("utf-8", errors="replace")
        except BaseException:
            helper.stop()
            raise
        logger.debug("MPI helper %d up: %s", pid, library)
        return helper

    def adopt(self, pid: int) -> None:
        """Hold the helper's process by a pidfd, so that a kill never reaches a reused pid."""
        if pid <= 1 or pid == os.getpid():
            raise self.failed(f"the helper said its pid is {pid}")
        self.pid = pid
        try:
            self.pidfd = os.pidfd_open(pid)
        except OSError as exc:  # no pidfd (an old kernel): killed by its pid
            logger.debug("no pidfd for the MPI helper %d: %s", pid, exc)

    # --- messages ----------------------------------------------------------------------------
    def send(
        self, code: Code, deadline: _Deadline, op: str, arg: int = 0, payload: memoryview | bytes = b""
    ) -> None:
        """Write one message; the helper's reader always drains, so this waits only on memory."""
        try:
            self.sock.settimeout(max(deadline.left(), 1e-3))
            self.sock.sendall(wire.pack(code, arg))
            if len(payload):
                self.sock.sendall(payload)
        except TimeoutError as exc:
            raise self.timed_out(op, arg, deadline) from exc
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise self.failed(f"{op}: the helper exited") from exc
        except OSError as exc:
            raise self.failed(f"{op}: cannot write to it ({exc})") from exc

    def read(
        self,
        deadline: _Deadline,
        op: str,
        cancelled: Callable[[], str | None] | None = None,
        nbytes: int = 0,
    ) -> tuple[Code, int]:
        """The next header (an ERROR raises); ``cancelled`` is asked every :data:`CANCEL_POLL_S`."""
        while cancelled is not None:
            left = deadline.left()
            if left <= 0 or select.select([self.sock], [], [], min(CANCEL_POLL_S, left))[0]:
                break
            why = cancelled()
            if why:
                self.stop()
                raise TransferError(f"mpi: {op} given up: {why}; the MPI helper is stopped")
        header = bytearray(wire.HEADER.size)
        self.fill(memoryview(header), deadline, op, nbytes)
        try:
            code, arg = wire.unpack(bytes(header), wire.FROM_HELPER)
        except ValueError as exc:
            raise self.failed(f"{op}: a malformed message: {exc}") from exc
        if code == Code.ERROR:
            raw = bytearray(arg)
            self.fill(memoryview(raw), deadline, op)
            raise self.failed(raw.decode("utf-8", errors="replace"))
        return code, arg

    def expect(
        self, want: Code, deadline: _Deadline, op: str, cancelled: Callable[[], str | None] | None = None
    ) -> bytes:
        """The payload of the next message, which must be ``want``."""
        code, arg = self.read(deadline, op, cancelled)
        if code != want:
            raise self.failed(f"{op}: expected {want.name}, got {code.name} ({arg})")
        payload = bytearray(arg if code in wire.WITH_PAYLOAD else 0)
        self.fill(memoryview(payload), deadline, op)
        return bytes(payload)

    def fill(self, view: memoryview, deadline: _Deadline, op: str, nbytes: int | None = None) -> None:
        """Read exactly ``len(view)`` bytes before ``deadline`` (for the ``nbytes`` of ``op``)."""
        done = 0
        try:
            while done < len(view):
                left = deadline.left()
                if left <= 0:
                    raise TimeoutError
                self.sock.settimeout(left)
                n = self.sock.recv_into(view[done:])
                if n == 0:
                    raise self.failed(f"{op}: the helper exited")
                done += n
        except TimeoutError as exc:
            raise self.timed_out(op, len(view) if nbytes is None else nbytes, deadline) from exc
        except ConnectionResetError as exc:  # it died with a command of ours unread
            raise self.failed(f"{op}: the helper exited") from exc
        except OSError as exc:
            raise self.failed(f"{op}: cannot read from it ({exc})") from exc

    def failed(self, what: str) -> TransferError:
        """A TransferError for a helper failure, with mpiexec's exit status and the tail of the
        helper's output; the helper is stopped first."""
        self.stop()
        parts = [f"mpiexec exit status {self.proc.returncode}"]
        if self.tail:
            parts.append(f"its output: {self.tail}")
        return TransferError(
            f"mpi: the MPI helper failed: {what} ({'; '.join(parts)})",
            hint="its MPI could not start or reach the peer, or it died; the transfer falls back",
        )

    def timed_out(self, op: str, nbytes: int, deadline: _Deadline) -> TransferError:
        self.stop()
        return timeout_error("mpi", op, nbytes, deadline.timeout, "the MPI helper is stopped")

    # --- the end -----------------------------------------------------------------------------
    def stop(self) -> None:
        """Kill and reap the helper and its mpiexec (module docstring); idempotent, bounded."""
        self.sock.close()  # a helper still running exits at this EOF
        if self.proc.returncode is None:
            for step in self._stop_steps():
                with contextlib.suppress(ProcessLookupError):  # gone already
                    step()
                if self._reaped():
                    break
            else:
                logger.warning("mpiexec %d (an MPI helper) outlived SIGKILL", self.proc.pid)
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        if not self.log.closed:
            self.log.seek(0, os.SEEK_END)
            self.log.seek(max(self.log.tell() - 4 * STDERR_TAIL_CHARS, 0))
            lines = self.log.read().decode("utf-8", errors="replace").splitlines()
            kept = (line.strip(" =") for line in lines)  # hydra frames its reports in "="
            self.tail = " | ".join(line for line in kept if line)[-STDERR_TAIL_CHARS:]
            self.log.close()

    def _stop_steps(self) -> list[Callable[[], None]]:
        """SIGKILL to the helper (hydra's proxy reaps it and exits, then mpiexec), SIGTERM to
        mpiexec (hydra's own teardown of its proxy and helper), SIGKILL to mpiexec's group."""
        pidfd, pid, mpiexec = self.pidfd, self.pid, self.proc.pid
        steps: list[Callable[[], None]] = []
        if pidfd is not None:
            steps.append(lambda: signal.pidfd_send_signal(pidfd, signal.SIGKILL))
        elif pid is not None:
            steps.append(lambda: os.kill(pid, signal.SIGKILL))
        steps.append(lambda: os.kill(mpiexec, signal.SIGTERM))
        steps.append(lambda: os.killpg(mpiexec, signal.SIGKILL))
        return steps

    def _reaped(self) -> bool:
        try:
            self.proc.wait(seconds(KILL_GRACE))
        except subprocess.TimeoutExpired:
            return False
        return True


@dataclass
class _Op:
    """A SEND or RECV handed to the helper, answered in the order they were handed."""

    code: Code
    buf: torch.Tensor
    done: bool = False


class _OpHandle(Handle):
    def __init__(self, transport: MPIProcessTransport, op: _Op) -> None:
        self._transport, self._op = transport, op

    def wait(self, timeout: timedelta) -> None:
        self._transport._complete(self._op, timeout)


class MPIProcessTransport(AsyncTransport):
    """Point-to-point over MPI, run by a helper process (module docstring)."""

    name = "mpi"

    def __init__(self, helper: _Helper) -> None:
        super().__init__()
        self._helper = helper
        self._pending: deque[_Op] = deque()
        self._closed = False

    @property
    def helper_pid(self) -> int | None:
        """The helper process's pid (gone once the transport is closed or failed)."""
        return self._helper.pid

    @classmethod
    def accept(
        cls,
        publish: Callable[[str], None],
        timeout: timedelta,
        cancelled: Callable[[], str | None] | None = None,
        *,
        launch: HelperLaunch | None = None,
    ) -> MPIProcessTransport:
        """Start a helper, hand its port name to ``publish``, accept one peer, all within
        ``timeout``. ``cancelled`` is asked twice a second while waiting for the peer: a reason
        (the peer said it will not come) ends the wait with a TransferError."""
        deadline = _Deadline(timeout)
        helper = _Helper.launch(launch or HelperLaunch.find(), deadline)
        try:
            helper.send(Code.ACCEPT, deadline, "accept")
            publish(helper.expect(Code.PORT, deadline, "open a port").decode("utf-8", errors="replace"))
            helper.expect(Code.CONNECTED, deadline, "accept", cancelled)
        except BaseException:
            helper.stop()
            raise
        return cls(helper)

    @classmethod
    def connect(
        cls, port_name: str, timeout: timedelta, *, launch: HelperLaunch | None = None
    ) -> MPIProcessTransport:
        """Start a helper and connect to the port opened by :meth:`accept` on the peer."""
        raw = port_name.encode("utf-8")
        if not 0 < len(raw) <= wire.MAX_TEXT:
            raise TransferError(f"mpi: a port name of {len(raw)} bytes (1 to {wire.MAX_TEXT} expected)")
        deadline = _Deadline(timeout)
        helper = _Helper.launch(launch or HelperLaunch.find(), deadline)
        try:
            helper.send(Code.CONNECT, deadline, "connect", len(raw), raw)
            helper.expect(Code.CONNECTED, deadline, "connect")
        except BaseException:
            helper.stop()
            raise
        return cls(helper)

    def _start(self, op: str, buf: torch.Tensor, timeout: timedelta) -> Handle:
        if buf.device.type != "cpu":
            raise TypeError(f"MPIProcessTransport needs CPU buffers, got one on {buf.device}")
        if buf.numel() > wire.MAX_MESSAGE:
            raise TransferError(f"mpi: a message of {buf.numel()} bytes (at most {wire.MAX_MESSAGE})")
        self._check_open(op)
        deadline = _Deadline(timeout)
        item = _Op(Code.SEND if op == "send" else Code.RECV, buf)
        payload = buf.numpy().data if op == "send" else b""
        self._helper.send(item.code, deadline, op, buf.numel(), payload)
        self._pending.append(item)
        return _OpHandle(self, item)

    def _complete(self, item: _Op, timeout: timedelta) -> None:
        """Read the helper's answers, oldest first, until ``item``'s came."""
        deadline = _Deadline(timeout)
        while not item.done:
            self._check_open("wait")
            head = self._pending[0]
            want, op = (Code.SENT, "send") if head.code == Code.SEND else (Code.DATA, "recv")
            code, arg = self._helper.read(deadline, op, nbytes=head.buf.numel())
            if code != want or arg != head.buf.numel():
                raise self._helper.failed(
                    f"{op}: expected {want.name} of {head.buf.numel()} bytes, got {code.name} ({arg})"
                )
            if code == Code.DATA:
                self._helper.fill(head.buf.numpy().data, deadline, op)
            head.done = True
            self._pending.popleft()

    def _check_open(self, op: str) -> None:
        if self._closed or self._helper.sock.fileno() == -1:
            raise TransferError(
                f"mpi: {op} after the MPI helper was stopped ({self._helper.tail or 'closed'})"
            )

    def close(self, timeout: timedelta = DISCONNECT_TIMEOUT) -> None:
        """Disconnect a healthy link (bounded by ``timeout``: the peer's side must come), then
        stop the helper; a broken link's helper is stopped at once."""
        if self._closed:
            return
        self._closed = True
        helper = self._helper
        try:
            if self.broken is None and not self._pending and helper.sock.fileno() != -1:
                deadline = _Deadline(timeout)
                helper.send(Code.CLOSE, deadline, "disconnect")
                helper.expect(Code.CLOSED, deadline, "disconnect")
        except TransferError as exc:
            logger.debug("MPI Disconnect did not complete: %s", exc)
        finally:
            helper.stop()
