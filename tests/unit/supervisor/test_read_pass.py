"""One pass of the supervisor's loop reads routine traffic (heartbeats, rank-state copies) until
its slice is spent, and ends at once on anything else: detection runs at most once per slice,
not once per heartbeat."""

from __future__ import annotations

from datetime import timedelta

from torchpass_slurm.control.messages import Message
from torchpass_slurm.supervisor.loop import POLL_SLICE, read_pass


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def monotonic(self) -> float:
        return self.t

    def time(self) -> float:
        return 1_700_000_000 + self.t


class Server:
    """Hands out one scripted batch per poll; each poll takes ``step`` seconds, as a poll that
    returns when a message arrives does."""

    def __init__(self, clock: Clock, batches: list[list[str]], step: float) -> None:
        self.clock, self.batches, self.step, self.polls = clock, batches, step, 0

    def poll(self, timeout: timedelta) -> list[tuple[bytes, Message]]:
        self.polls += 1
        self.clock.t += min(self.step, timeout.total_seconds())
        kinds = self.batches.pop(0) if self.batches else []
        return [(b"c1/0", Message(k, "c1/0", i, 0.0, {})) for i, k in enumerate(kinds)]


def run(batches: list[list[str]], step: float = 0.02) -> tuple[Server, list[str], float]:
    clock = Clock()
    server = Server(clock, batches, step)
    taken: list[str] = []

    def take(peer: bytes, message: Message, now: float) -> None:
        taken.append(message.kind)

    read_pass(server, clock, POLL_SLICE, take)  # type: ignore[arg-type]
    return server, taken, clock.t


def test_heartbeats_do_not_end_the_pass_before_its_slice_is_spent() -> None:
    server, taken, spent = run([["heartbeat"], ["rank_state"], ["heartbeat"], ["heartbeat"]])
    assert taken == ["heartbeat", "rank_state", "heartbeat", "heartbeat"]
    assert abs(spent - POLL_SLICE.total_seconds()) < 1e-9 and server.polls == 5


def test_a_report_ends_the_pass_at_once() -> None:
    server, taken, spent = run([["heartbeat"], ["report"], ["heartbeat"]])
    assert taken == ["heartbeat", "report"] and server.polls == 2
    assert spent < POLL_SLICE.total_seconds()


def test_a_quiet_pass_is_one_poll_of_the_whole_slice() -> None:
    server, taken, spent = run([], step=1.0)
    assert (taken, server.polls, spent) == ([], 1, POLL_SLICE.total_seconds())
