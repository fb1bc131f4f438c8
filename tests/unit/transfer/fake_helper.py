"""Stand-ins for MPICH's hydra and for the MPI helper, for test_mpi_process.py's hostile cases.

``fake_helper.py hydra OPTIONS... PYTHON SCRIPT FD`` is hydra: it refuses any command line but
the launch's (``HYDRA_OPTIONS -hosts HOST -n 1``) and runs ``PYTHON SCRIPT FD`` in its place.

``fake_helper.py FD`` is a helper that talks as the real one does until it misbehaves the way
``TP_FAKE_HELPER`` says:

- ``exit-early``: says why on stderr and exits 7 before HELLO;
- ``bad-pid``: says its pid is 1;
- ``bad-magic``: answers CONNECT with a header that is not one;
- ``huge-port``: answers ACCEPT with a PORT of more than MAX_TEXT bytes;
- ``error``: answers CONNECT with ERROR "cannot init MPI: ...";
- ``short-data``: connects, then answers RECV n with DATA of n - 1 bytes;
- ``hang``: connects, then reads commands and never answers.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from torchpass_slurm.transfer import mpi_helper as wire
from torchpass_slurm.transfer.mpi_helper import Code
from torchpass_slurm.transfer.mpi_process import HYDRA_OPTIONS


def hydra(args: list[str]) -> None:
    n = len(HYDRA_OPTIONS)
    if tuple(args[:n]) != HYDRA_OPTIONS or args[n] != "-hosts" or args[n + 2 : n + 4] != ["-n", "1"]:
        sys.exit(f"fake hydra: unexpected options {args}")
    program = args[n + 4 :]
    os.execv(program[0], program)


def command(sock: socket.socket) -> tuple[Code, int]:
    raw = sock.recv(wire.HEADER.size, socket.MSG_WAITALL)
    code, arg = wire.unpack(raw, wire.FROM_RANK)
    if code in wire.WITH_PAYLOAD:
        sock.recv(arg, socket.MSG_WAITALL)
    return code, arg


def helper(fd: int, scenario: str) -> None:
    if scenario == "exit-early":
        sys.stderr.write("boom: the helper's last words\n")
        sys.exit(7)
    sock = socket.socket(fileno=fd)
    pid = 1 if scenario == "bad-pid" else os.getpid()
    sock.sendall(wire.pack(Code.HELLO, 8) + struct.pack("<Q", pid))
    sock.sendall(wire.pack(Code.READY, 4) + b"fake")
    code, _ = command(sock)
    if scenario == "bad-magic":
        sock.sendall(b"XXXX" + wire.pack(Code.CONNECTED)[4:])
    elif scenario == "huge-port":
        sock.sendall(wire.pack(Code.PORT, wire.MAX_TEXT + 1))
    elif scenario == "error":
        message = b"cannot init MPI: RuntimeError: the test said so"
        sock.sendall(wire.pack(Code.ERROR, len(message)) + message)
    else:
        sock.sendall(wire.pack(Code.CONNECTED))
    while scenario in ("short-data", "hang"):
        code, arg = command(sock)
        if scenario == "short-data" and code == Code.RECV:
            sock.sendall(wire.pack(Code.DATA, arg - 1) + bytes(arg - 1))
    time.sleep(60)


if __name__ == "__main__":
    if sys.argv[1] == "hydra":
        hydra(sys.argv[2:])
    else:
        helper(int(sys.argv[1]), os.environ["TP_FAKE_HELPER"])
