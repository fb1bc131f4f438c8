"""The rendezvous store in a process of its own (issue 22): its death leaves the supervisor
alive, it never outlives the supervisor, and it needs no torch. Outsiders and floods:
``tests/unit/control/test_store_attacks.py``."""

from __future__ import annotations

import datetime
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.processes import gone_within
from torchpass_slurm.control.secret import create_secret, load_secret
from torchpass_slurm.supervisor.store_host import StoreHost

TIMEOUT = datetime.timedelta(seconds=20)


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    return create_secret(tmp_path)


@pytest.fixture
def store(secret_file: Path) -> Iterator[StoreHost]:
    host = StoreHost.start("127.0.0.1", secret_file, TIMEOUT)
    yield host
    host.close()


def test_the_store_serves_the_job_from_a_child_process(store: StoreHost, secret_file: Path) -> None:
    pytest.importorskip("torch")
    from torchpass_slurm.rank.store import JobStore

    assert store.proc.pid != os.getpid() and store.alive()
    client = JobStore("127.0.0.1", store.port, load_secret(secret_file), TIMEOUT)
    client.set("k", "v")
    assert client.get("k") == b"v"
    assert client.add("n", 2) == 2 and client.add("n", 3) == 5


def test_the_store_process_loads_no_torch(store: StoreHost) -> None:
    with open(f"/proc/{store.proc.pid}/maps") as f:
        assert "libtorch" not in f.read(), "the store host imported torch; it needs only zmq"


def test_a_missing_secret_is_a_clear_error(tmp_path: Path) -> None:
    from torchpass_slurm.errors import ControlPlaneError

    with pytest.raises(ControlPlaneError, match="the rendezvous store did not start"):
        StoreHost.start("127.0.0.1", tmp_path / "no-such-secret", TIMEOUT)


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


def test_the_store_never_outlives_a_killed_supervisor(secret_file: Path) -> None:
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import datetime, pathlib, time
            from torchpass_slurm.supervisor.store_host import StoreHost
            host = StoreHost.start("127.0.0.1", pathlib.Path({str(secret_file)!r}),
                                   datetime.timedelta(seconds=20))
            print(host.proc.pid, flush=True)
            time.sleep(600)
        """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    parent.kill()  # SIGKILL: no cleanup runs in the supervisor
    parent.wait()
    assert gone_within(child, 10), "the store outlived its supervisor"
