"""The donor's test hooks: read from the environment in one place, refused when malformed."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")

from tests.unit.transfer.fakes import queue_pair  # noqa: E402
from torchpass_slurm.errors import ConfigError  # noqa: E402
from torchpass_slurm.transfer import hooks  # noqa: E402
from torchpass_slurm.transfer.hooks import (  # noqa: E402
    ENV_CORRUPT_CHUNKS,
    ENV_STALL_CHUNK,
    corrupt_chunks_from_env,
    stall_from_env,
)
from torchpass_slurm.transfer.stream import ReceiveProgress, recv_state, send_state  # noqa: E402

TIMEOUT = timedelta(seconds=10)


def test_unset_hooks_do_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_CORRUPT_CHUNKS, raising=False)
    monkeypatch.delenv(ENV_STALL_CHUNK, raising=False)
    assert corrupt_chunks_from_env() == frozenset()
    assert stall_from_env() is None


@pytest.mark.parametrize("raw", ["1", "x:3", "1:y", "-1:3", "1:-2", "1:3601", ":", "1:nan"])
def test_a_malformed_stall_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(ENV_STALL_CHUNK, raw)
    with pytest.raises(ConfigError, match="CHUNK:SECONDS"):
        stall_from_env()


def test_a_donor_stalls_before_the_chunk_asked_and_the_stream_completes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_STALL_CHUNK, "2:0.6")
    monkeypatch.setattr(hooks, "_stalled", False)
    assert stall_from_env() == (2, 0.6)
    state = {"w": torch.arange(64, dtype=torch.float32)}  # 256 bytes: 4 chunks of 64
    donor_end, receiver_end = queue_pair()
    progress = ReceiveProgress()
    arrived: list[tuple[float, int]] = []

    def receive() -> None:
        got, _ = recv_state(receiver_end, timeout=TIMEOUT, progress=progress)
        arrived.append((time.monotonic(), int(got["w"].sum())))

    receiver = threading.Thread(target=receive)
    receiver.start()
    began = time.monotonic()
    stats = send_state(donor_end, state, timeout=TIMEOUT, chunk_bytes=64)
    receiver.join(timeout=10)
    assert arrived and arrived[0][1] == int(state["w"].sum())
    assert stats.chunks == 4
    assert arrived[0][0] - began >= 0.6, "the donor did not wait before chunk 2"
    assert hooks.take_stall() is None, "a process stalls once"
