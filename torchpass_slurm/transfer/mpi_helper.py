"""The MPI helper: a process of its own that moves a transfer's bytes over MPI for a rank.

A training rank never runs MPI itself (docs/design/transfer.md, "MPI"): two MPI libraries cannot
share a process (Debian trixie's torch links Open MPI; the helper's MPI is the MPICH wheel), and
an MPI call cannot be interrupted, so a stuck one must be in a process that can be killed.
:mod:`.mpi_process` starts this file BY PATH under MPICH's ``mpiexec -n 1``, so it imports only
the standard library and, once started, mpi4py: never torch, never the torchpass_slurm package.
The rank imports this module only for the wire vocabulary below.

Usage: ``python mpi_helper.py FD`` where FD is the helper's end of an AF_UNIX socket pair,
inherited from the rank through mpiexec. Over it, every message is a 16-byte header
``"TPMH" u16 version u16 code u64 arg`` (little endian), and for some codes a payload of
``arg`` bytes::

    rank -> helper                          helper -> rank
                                            HELLO      arg 8, payload u64 pid of the helper
                                            READY      arg n, payload the MPI library's name
    ACCEPT     arg 0                        PORT       arg n, payload the port name
                                            CONNECTED  arg 0
    CONNECT    arg n, payload a port name   CONNECTED  arg 0
    SEND       arg n, payload n bytes       SENT       arg n     (the MPI send completed)
    RECV       arg n                        DATA       arg n, payload n bytes
    CLOSE      arg 0                        CLOSED     arg 0     (after MPI Disconnect)
                                            ERROR      arg n, payload a message; then it exits

SEND and RECV are posted at once (``Isend``/``Irecv``) and answered in the order they were
posted. Three threads: the main one runs MPI (only it calls MPI); a reader takes the rank's
commands and their payloads as they come, and a writer sends the answers, so neither the rank
nor MPI ever waits on the other. The helper exits at once when the rank's end closes (the rank
died or gave up), and with a message on stderr at a malformed header; nothing it reads is
unpickled or evaluated.
"""

from __future__ import annotations

import enum
import os
import queue
import socket
import stat
import struct
import sys
import threading
import time
from collections import deque
from typing import Any, NamedTuple, NoReturn

#: The header of every message: magic, protocol version, code, argument.
HEADER = struct.Struct("<4sHHQ")
MAGIC = b"TPMH"
VERSION = 1
#: Largest port name, library name or error message.
MAX_TEXT = 4096
#: Largest SEND or RECV: an MPI count of bytes is a C int.
MAX_MESSAGE = (1 << 31) - 1
#: The MPI tag of the transfer's messages.
TAG = 7078
#: Exit codes: the rank's end closed, a malformed message, an MPI failure (reported as ERROR).
EXIT_PARENT_GONE, EXIT_PROTOCOL, EXIT_MPI = 3, 4, 5


class Code(enum.IntEnum):
    """What a message says (module docstring)."""

    ACCEPT = 1
    CONNECT = 2
    SEND = 3
    RECV = 4
    CLOSE = 5
    HELLO = 16
    READY = 17
    PORT = 18
    CONNECTED = 19
    SENT = 20
    DATA = 21
    CLOSED = 22
    ERROR = 23


#: The codes each side sends, and those that carry a payload of ``arg`` bytes.
FROM_RANK = frozenset({Code.ACCEPT, Code.CONNECT, Code.SEND, Code.RECV, Code.CLOSE})
FROM_HELPER = frozenset(Code) - FROM_RANK
WITH_PAYLOAD = frozenset({Code.CONNECT, Code.SEND, Code.HELLO, Code.READY, Code.PORT, Code.DATA, Code.ERROR})


def pack(code: Code, arg: int = 0) -> bytes:
    """The header of a message."""
    return HEADER.pack(MAGIC, VERSION, code, arg)


def unpack(raw: bytes, expected: frozenset[Code]) -> tuple[Code, int]:
    """``(code, arg)`` of a header; ValueError saying what is wrong with it."""
    magic, version, code, arg = HEADER.unpack(raw)
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"not a helper header (magic {magic!r}, version {version}): {raw.hex()}")
    if code not in expected:
        raise ValueError(f"unexpected message code {code} (arg {arg})")
    if code == Code.HELLO and arg != 8:
        raise ValueError(f"HELLO with an argument of {arg}, not 8")
    limit = MAX_MESSAGE if code in (Code.SEND, Code.RECV, Code.SENT, Code.DATA) else MAX_TEXT
    if arg > limit:
        raise ValueError(f"{Code(code).name} with an argument of {arg}, above its limit of {limit}")
    return Code(code), arg


# --- the helper process ------------------------------------------------------------------------


def fail(code: int, message: str) -> NoReturn:
    """Say why on stderr (the rank shows its tail) and exit now, whatever the MPI thread does."""
    sys.stderr.write(f"tp-mpi-helper: {message}\n")
    sys.stderr.flush()
    os._exit(code)


def recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view``; False at EOF."""
    done = 0
    while done < len(view):
        n = sock.recv_into(view[done:])
        if n == 0:
            return False
        done += n
    return True


def read_commands(sock: socket.socket, commands: queue.Queue[tuple[Code, int, bytearray]]) -> None:
    """The reader thread: every command, its payload read in full, into ``commands``. It always
    drains the socket, so the rank's sends never wait on the MPI thread's replies."""
    header = bytearray(HEADER.size)
    while True:
        if not recv_exact(sock, memoryview(header)):
            fail(EXIT_PARENT_GONE, "the rank closed its end; exiting")
        try:
            code, arg = unpack(bytes(header), FROM_RANK)
        except ValueError as exc:
            fail(EXIT_PROTOCOL, f"malformed command from the rank: {exc}")
        payload = bytearray(arg if code in WITH_PAYLOAD else 0)
        if not recv_exact(sock, memoryview(payload)):
            fail(EXIT_PARENT_GONE, f"the rank closed its end inside a {code.name} of {arg} bytes")
        commands.put((code, arg, payload))


class Exit(NamedTuple):
    """For the writer thread: end the process once the answers before it are written."""

    code: int
    message: str = ""


def write_replies(sock: socket.socket, replies: queue.Queue[tuple[bytes, bytes | bytearray] | Exit]) -> None:
    """The writer thread: every answer, in order, so that the MPI thread never waits on the rank
    reading them (MPI keeps progressing while a DATA is on its way)."""
    while True:
        item = replies.get()
        if isinstance(item, Exit):
            if item.message:
                fail(item.code, item.message)
            os._exit(item.code)
        try:
            sock.sendall(item[0])
            if item[1]:
                sock.sendall(item[1])
        except OSError as exc:
            fail(EXIT_PARENT_GONE, f"the rank's end is gone ({exc}); exiting")


class Helper:
    """The MPI thread (the main thread): meets the peer, then posts and completes operations."""

    def __init__(self, sock: socket.socket) -> None:
        self.commands: queue.Queue[tuple[Code, int, bytearray]] = queue.Queue()
        self.replies: queue.Queue[tuple[bytes, bytes | bytearray] | Exit] = queue.Queue()
        self.MPI: Any = None
        self.comm: Any = None
        threading.Thread(target=read_commands, args=(sock, self.commands), daemon=True).start()
        threading.Thread(target=write_replies, args=(sock, self.replies), daemon=True).start()

    def reply(self, code: Code, payload: bytes | bytearray = b"", arg: int | None = None) -> None:
        self.replies.put((pack(code, len(payload) if arg is None else arg), payload))

    def end(self, code: int, message: str = "") -> NoReturn:
        """Exit once the answers so far are written (the writer thread ends the process)."""
        self.replies.put(Exit(code, message))
        while True:
            time.sleep(60)

    def error(self, message: str) -> NoReturn:
        """Tell the rank why, then exit (MPI is not finalized: that could hang)."""
        self.reply(Code.ERROR, message.encode("utf-8", errors="replace")[:MAX_TEXT])
        self.end(EXIT_MPI, message)

    def start_mpi(self) -> None:
        try:
            from mpi4py import MPI
        # Deliberately broad: MPI_Init fails in the library's own way (ImportError for a missing
        # libmpi, RuntimeError from mpi4py's loader, MPI.Exception, ...); saying why is the point.
        except Exception as exc:
            self.error(f"cannot init MPI: {type(exc).__name__}: {first_line(exc)}")
        self.MPI = MPI
        MPI.COMM_SELF.Set_errhandler(MPI.ERRORS_RETURN)
        self.reply(Code.READY, first_line(MPI.Get_library_version()).encode()[:MAX_TEXT])

    def meet(self) -> None:
        """ACCEPT (open a port, say its name, accept) or CONNECT, then CONNECTED."""
        code, _, payload = self.commands.get()
        MPI = self.MPI
        try:
            if code == Code.ACCEPT:
                port = MPI.Open_port()
                self.reply(Code.PORT, port.encode())
                self.comm = MPI.COMM_SELF.Accept(port)
                MPI.Close_port(port)
            elif code == Code.CONNECT:
                self.comm = MPI.COMM_SELF.Connect(payload.decode("utf-8", errors="replace"))
            else:
                fail(EXIT_PROTOCOL, f"{code.name} before ACCEPT or CONNECT")
        except MPI.Exception as exc:
            self.error(f"{code.name.lower()} failed: {first_line(exc)}")
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.reply(Code.CONNECTED)

    def serve(self) -> NoReturn:
        """Post each SEND/RECV at once; answer the oldest as soon as MPI completed it; CLOSE."""
        MPI = self.MPI
        pending: deque[tuple[Code, Any, bytearray]] = deque()
        status = MPI.Status()
        pause = 0.0
        while True:
            try:
                code, arg, payload = self.commands.get(timeout=pause if pending else None)
            except queue.Empty:
                code = None
            try:
                if code is Code.SEND:
                    pending.append((code, self.comm.Isend([payload, MPI.BYTE], 0, TAG), payload))
                elif code is Code.RECV:
                    buf = bytearray(arg)
                    pending.append((code, self.comm.Irecv([buf, MPI.BYTE], 0, TAG), buf))
                elif code is Code.CLOSE:
                    if pending:
                        fail(EXIT_PROTOCOL, f"CLOSE with {len(pending)} operation(s) in flight")
                    self.comm.Disconnect()
                    MPI.Finalize()
                    self.reply(Code.CLOSED)
                    self.end(0)
                elif code is not None:
                    fail(EXIT_PROTOCOL, f"{code.name} after the connection was made")
                progress = code is not None
                while pending and pending[0][1].Test(status):
                    op, _, buf = pending.popleft()
                    if op is Code.SEND:
                        self.reply(Code.SENT, arg=len(buf))
                    elif status.Get_count(MPI.BYTE) != len(buf):
                        self.error(f"expected a {len(buf)}-byte message, got {status.Get_count(MPI.BYTE)}")
                    else:
                        self.reply(Code.DATA, buf)
                    progress = True
            except MPI.Exception as exc:
                self.error(f"an MPI operation failed: {first_line(exc)}")
            pause = 0.0 if progress else min(pause * 2 or 20e-6, 1e-3)


def first_line(exc: object) -> str:
    return (str(exc).strip() or type(exc).__name__).splitlines()[0]


def main(argv: list[str]) -> NoReturn:
    if len(argv) != 1 or not argv[0].isdigit():
        fail(EXIT_PROTOCOL, f"usage: mpi_helper.py FD (the rank's socket), got {argv}")
    fd = int(argv[0])
    try:
        is_socket = stat.S_ISSOCK(os.fstat(fd).st_mode)
    except OSError as exc:
        fail(EXIT_PROTOCOL, f"fd {fd} is not open here ({exc}): did the launcher close it?")
    if not is_socket:
        fail(EXIT_PROTOCOL, f"fd {fd} is not the rank's socket")
    helper = Helper(socket.socket(fileno=fd))
    helper.reply(Code.HELLO, struct.pack("<Q", os.getpid()))
    helper.start_mpi()
    helper.meet()
    helper.serve()


if __name__ == "__main__":
    # Run by path: its own folder (the package's sources) must not shadow a module it imports.
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]
    main(sys.argv[1:])
