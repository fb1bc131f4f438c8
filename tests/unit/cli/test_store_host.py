"""The rendezvous store in a process of its own (issue 22): a flood, or its death, leaves
the supervisor alive, and it never outlives the supervisor.

torch's TCPStore server listens on every interface whatever host it is given (measured:
``*:PORT``), so binding the job's address needs a store of this project's own."""

from __future__ import annotations

import datetime
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("torch")

from tests.unit.processes import gone_within
from torchpass_slurm.cli.store_host import StoreHost
from torchpass_slurm.rank.rendezvous import make_tcp_store

TIMEOUT = datetime.timedelta(seconds=20)
FLOOD = 1_100  # what used to abort tp run (its descriptors, then std::terminate in the store thread)


@pytest.fixture
def store() -> Iterator[StoreHost]:
    host = StoreHost.start("127.0.0.1", TIMEOUT)
    assert host is not None
    yield host
    host.close()


def roundtrip(port: int, key: str) -> bytes:
    client = make_tcp_store("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    client.set(key, "v")
    return bytes(client.get(key))


def test_the_store_serves_from_a_child_process(store: StoreHost) -> None:
    assert store.proc.pid != os.getpid() and store.alive()
    assert roundtrip(store.port, "k") == b"v"


def test_a_flood_of_idle_connections_leaves_the_supervisor_and_the_store_alive(store: StoreHost) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < FLOOD + 256:
        pytest.skip(f"this host allows {hard} open files; the flood needs {FLOOD + 256}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, FLOOD + 256), hard))
    try:
        conns = [socket.create_connection(("127.0.0.1", store.port), timeout=5) for _ in range(FLOOD)]
        time.sleep(1)
        assert store.alive(), "the store died of the flood"
        for conn in conns:
            conn.close()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    time.sleep(1)
    assert store.alive(), "the store died once the flood ended"
    # torch's store then serves the next client only after about 95 ms per idle connection
    # it was sent (104 s after 1,100, measured): it survives the flood, it is not fast after
    # one. A store that admits only the job's ranks is the fix (docs/security.md).


def test_the_stores_death_is_logged_and_the_supervisor_lives_on(
    store: StoreHost, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    os.kill(store.proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while "rendezvous store" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not store.alive()
    assert f"the rendezvous store (pid {store.proc.pid}) ended with status -9" in caplog.text


def test_the_store_never_outlives_a_killed_supervisor() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import datetime, sys, time
            from torchpass_slurm.cli.store_host import StoreHost
            host = StoreHost.start("127.0.0.1", datetime.timedelta(seconds=20))
            print(host.proc.pid, flush=True)
            time.sleep(600)
        """)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    parent.kill()  # SIGKILL: no cleanup runs in the supervisor
    parent.wait()
    assert gone_within(child, 10), "the store outlived its supervisor"


def test_no_torch_no_store(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert StoreHost.start("127.0.0.1", TIMEOUT) is None

