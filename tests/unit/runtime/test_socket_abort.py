"""The abort of a frozen peer's group: its gloo sockets are shut down from the heartbeat thread.

A frozen or cut-off peer sends nothing, so a survivor in a collective with
it waits for the collective timeout unless something else ends the wait;
gloo's ``ProcessGroup.abort`` does not (torch 2.13) or is not there (torch
2.6). The abort shuts down the TCP sockets the group opened at init: the
survivor's collective raises a gloo error at once. Only sockets that are
still the ones recorded are touched, and never those of the reconfigured
epoch's group.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from torchpass_slurm.control.bodies import Reconfigure
from torchpass_slurm.rank import backends, group
from torchpass_slurm.rank.elastic import is_comm_error
from torchpass_slurm.rank.runtime import Role, Runtime, make_tcp_store

from ..gloo_ranks import FakeClient, free_port, info

LOG = logging.LoggerAdapter(logging.getLogger(__name__), {})
#: The survivor's collective timeout: far longer than the test may wait for it to leave.
PEER_TIMEOUT_S = 60
#: The survivor must leave its collective within this of the abort.
LEAVE_WITHIN_S = 2.0
#: When the reconfigure arrives after the peer froze (as ``benchmarks/experiments/dead_collective.py``).
ABORT_AFTER_S = 0.5
WAIT_S = 60
LOOPING_AFTER = 20

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="Linux only (/proc/self/fd)")


class Msg:
    def __init__(self, kind: str, body: dict[str, Any]) -> None:
        self.kind, self.body = kind, body


class OldGroup:
    """A torch 2.6 gloo group: no abort, so only the sockets can end a collective."""


def inode(sock: socket.socket) -> int:
    return os.fstat(sock.fileno()).st_ino


def still_connected(a: socket.socket, b: socket.socket) -> bool:
    a.sendall(b"x")
    b.settimeout(2)
    return b.recv(1) == b"x"


def recorded(sock: socket.socket) -> group.GroupSocket:
    return group.GroupSocket(sock.fileno(), inode(sock))


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


# --- a survivor and a frozen peer, real gloo processes ------------------------------------------


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def _rank(rank: int, port: int, out: str) -> None:
    """All-reduce until it fails; rank 0 also hears the reconfigure once the test froze rank 1."""
    import threading

    outdir = Path(out)
    rt = Runtime(Role.ACTIVE, info(rank, 2, port), environ={}, client=FakeClient())
    rt.init_process_group("gloo", datetime.timedelta(seconds=PEER_TIMEOUT_S))
    assert group._live is not None
    (outdir / f"sockets{rank}").write_text(str(len(group._live.sockets)))

    def heartbeat() -> None:  # what the heartbeat thread does when the supervisor announces epoch 1
        _wait_for(outdir / "stopped")
        time.sleep(ABORT_AFTER_S)
        body = Reconfigure(epoch=1, world_size=1, store_addr="127.0.0.1", store_port=port)
        (outdir / "aborted").write_text(repr(time.monotonic()))
        rt._on_message(Msg("reconfigure", body.to_body()))

    if rank == 0:
        threading.Thread(target=heartbeat, daemon=True).start()
    data = torch.ones(1 << 12)
    step = 0
    try:
        while True:
            dist.all_reduce(data)
            step += 1
            if step == LOOPING_AFTER:
                (outdir / f"looping{rank}").write_text("")
    except RuntimeError as exc:
        (outdir / "left").write_text(repr(time.monotonic()))
        (outdir / "error").write_text(f"{type(exc).__name__}: {exc}")
        (outdir / "comm_error").write_text(str(is_comm_error(exc)))
    os._exit(0)


def test_a_survivor_leaves_a_collective_with_a_frozen_peer_once_the_reconfigure_aborts_the_group(
    tmp_path: Path,
) -> None:
    port = free_port()
    keep = make_tcp_store("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=WAIT_S))
    ctx = multiprocessing.get_context("spawn")
    survivor, peer = (ctx.Process(target=_rank, args=(r, port, str(tmp_path))) for r in range(2))
    survivor.start()
    peer.start()
    try:
        for r in range(2):
            _wait_for(tmp_path / f"looping{r}")
        assert peer.pid is not None
        os.kill(peer.pid, signal.SIGSTOP)  # a frozen node: its sockets stay open, nothing arrives
        (tmp_path / "stopped").write_text("")
        survivor.join(WAIT_S)
    finally:
        for p in (survivor, peer):
            if p.is_alive():
                p.kill()
            p.join()
        del keep

    assert (tmp_path / "sockets0").read_text() == "1"  # the mesh of two ranks, the store's left out
    left = float((tmp_path / "left").read_text())
    aborted = float((tmp_path / "aborted").read_text())
    error = (tmp_path / "error").read_text()
    assert left - aborted < LEAVE_WITHIN_S, (left - aborted, error)
    assert (tmp_path / "comm_error").read_text() == "True", error


# --- which sockets are recorded ----------------------------------------------------------------


def test_the_group_sockets_are_the_connected_tcp_sockets_opened_since_less_the_stores() -> None:
    with socket.create_server(("127.0.0.1", 0)) as store, socket.create_server(("127.0.0.1", 0)) as mesh:
        store_port, mesh_port = store.getsockname()[1], mesh.getsockname()[1]
        old = socket.create_connection(("127.0.0.1", mesh_port))  # there before the group
        old_peer, _ = mesh.accept()
        before = group.socket_inodes()
        to_store = socket.create_connection(("127.0.0.1", store_port))
        from_store, _ = store.accept()
        listener = socket.create_server(("127.0.0.1", 0))  # gloo's own listener
        out = socket.create_connection(("127.0.0.1", mesh_port))
        accepted, _ = mesh.accept()
        unix_a, unix_b = socket.socketpair()
        try:
            found = set(group.group_sockets(before, exclude_ports={store_port}))
            expected = {recorded(out), recorded(accepted)}
        finally:
            for s in (old, old_peer, to_store, from_store, listener, out, accepted, unix_a, unix_b):
                s.close()

    assert found == expected


def test_no_socket_is_recorded_without_proc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(group, "PROC_FD", "/nonexistent/fd")
    assert group.socket_inodes() == {}
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()):
        assert group.group_sockets({}, exclude_ports=()) == ()


def test_only_a_gloo_group_has_its_sockets_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    adopted: list[tuple[int, tuple[group.GroupSocket, ...]]] = []
    monkeypatch.setattr(backends, "adopt_group", lambda epoch, sockets: adopted.append((epoch, sockets)))
    monkeypatch.setattr(backends, "group_sockets", lambda before, exclude_ports: (group.GroupSocket(9, 1),))
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: None)
    FIVE_S = datetime.timedelta(seconds=5)

    assert backends.GlooBackend("mpi").create(info(0, 1, 1, epoch=3), FIVE_S, LOG) == 0
    assert backends.GlooBackend("gloo").create(info(0, 1, 1, epoch=4), FIVE_S, LOG) == 1
    assert adopted == [(3, ()), (4, (group.GroupSocket(9, 1),))]


# --- what the abort touches --------------------------------------------------------------------


def test_the_abort_shuts_down_a_recorded_socket_and_never_closes_its_descriptor(
    pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = pair
    monkeypatch.setattr(group, "_live", group._Live(OldGroup(), epoch=0, sockets=(recorded(a),)))

    assert group.abort_group_before(1, LOG)

    b.settimeout(2)
    assert b.recv(1) == b""  # the peer sees the end at once
    os.fstat(a.fileno())  # gloo's descriptor is still open (it closes it itself)
    assert not group.abort_group_before(2, LOG)  # never twice


def test_the_abort_leaves_a_descriptor_alone_whose_inode_changed(
    pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = pair
    real = group._socket_inode
    monkeypatch.setattr(group, "_socket_inode", lambda fd: None if real(fd) is None else inode(a) + 1)
    monkeypatch.setattr(group, "_live", group._Live(OldGroup(), epoch=0, sockets=(recorded(a),)))

    assert not group.abort_group_before(1, LOG)  # nothing shut down, and no ProcessGroup.abort
    assert still_connected(a, b) and still_connected(b, a)


def test_the_abort_leaves_a_reused_descriptor_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = socket.socketpair()
    gone = recorded(a)
    a.close()  # the old group's socket is gone; the next socket gets its number
    c, d = socket.socketpair()
    try:
        assert c.fileno() == gone.fd and inode(c) != gone.inode
        monkeypatch.setattr(group, "_live", group._Live(OldGroup(), epoch=0, sockets=(gone,)))

        assert not group.abort_group_before(1, LOG)
        assert still_connected(c, d) and still_connected(d, c)
    finally:
        for s in (b, c, d):
            s.close()


def test_the_sockets_of_the_reconfigured_epochs_group_are_never_shut_down(
    pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = pair  # the training thread has already rejoined epoch 2
    monkeypatch.setattr(group, "_live", group._Live(OldGroup(), epoch=2, sockets=(recorded(a),)))

    assert not group.abort_group_before(2, LOG)
    assert not group.abort_group_before(1, LOG)  # a late reconfigure of an older epoch
    assert still_connected(a, b) and still_connected(b, a)


def test_no_socket_is_shut_down_while_the_training_thread_destroys_the_group(
    pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = pair
    monkeypatch.setattr(group, "_live", group._Live(OldGroup(), epoch=0, sockets=(recorded(a),)))
    with group._lock:
        assert not group.abort_group_before(1, LOG)
    assert still_connected(a, b)
