"""Contract, the rank's half: what the real :class:`~torchpass_slurm.rank.runtime.Runtime` sends
passes the supervisor's real decode and reads back with the classes the supervisor reads.

The supervisor's unit tests run against simulated ranks (``tests/unit/supervisor/fakes.py``,
checked by ``test_wire_contract.py``); this test holds the real sender to the same classes, so
that the fakes and the runtime cannot drift apart without one of the two failing.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from torchpass_slurm.config import SupervisorConfig
from torchpass_slurm.control import messages as m
from torchpass_slurm.control.kinds import Kind, ReportKind
from torchpass_slurm.control.rank_bodies import Hello, Standby
from torchpass_slurm.control.reports import Report
from torchpass_slurm.rank import runtime

SECRET = b"r" * 32
FAST = SupervisorConfig(heartbeat_interval=0.01)
ENV = {
    "TORCHPASS_CONTROL": "tcp://ctl:5555",
    "TORCHPASS_SECRET_FILE": "/run/secret",
    "TORCHPASS_ROLE": "spare",
    "TORCHPASS_JOB_ID": "42",
    "TORCHPASS_NODE": "c2",
    "TORCHPASS_EPOCH": "0",
    "TORCHPASS_NTASKS_PER_NODE": "1",
    "SLURM_LOCALID": "0",
}
PROMOTE = {
    "rank": 2,
    "local_rank": 0,
    "world_size": 4,
    "master_addr": "c1",
    "master_port": 29401,
    "epoch": 4,
    "mode": "live",
    "store_addr": "c1",
    "store_port": 29400,
}


@dataclass
class Received:
    kind: str
    body: dict[str, Any]
    typed: object = None


@dataclass
class SigningClient:
    """A control client whose every message is signed and decoded as the supervisor's socket does."""

    inbox: queue.Queue[Received] = field(default_factory=queue.Queue)
    decoded: list[m.Message] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, kind: str, body: dict[str, Any]) -> None:
        msg = m.Message(kind, "c2/0", time.time_ns() // 1000, time.time(), body)
        with self.lock:
            self.decoded.append(m.decode(m.encode(msg, SECRET), SECRET, allowed=m.WORKER_KINDS))

    def recv(self, timeout: timedelta) -> Received | None:
        try:
            return self.inbox.get(timeout=timeout.total_seconds())
        except queue.Empty:
            return None

    def close(self) -> None:
        pass


def test_what_a_promoted_spare_sends_is_what_the_supervisor_reads() -> None:
    client = SigningClient()
    promote = m.decode(
        m.encode(m.Message(Kind.PROMOTE, m.SUPERVISOR, 1, time.time(), PROMOTE, to="c2/0"), SECRET),
        SECRET,
        allowed=m.SUPERVISOR_KINDS,
    )
    client.inbox.put(Received(promote.kind, dict(promote.body), promote.typed))
    rt = runtime.init(dict(ENV), client_factory=lambda *_: client, config=FAST)
    assert rt.promotion is promote.typed  # the spare's one parse of its promote was decode's
    rt.report_step(5)
    rt.report(ReportKind.LIVE_READY, step=-1, epoch=rt.epoch)
    rt.report(ReportKind.GROUP_REBUILT, seconds=0.25, epoch=rt.epoch)
    rt.report(
        ReportKind.TRANSFER_DONE,
        donor=0,
        receiver=2,
        step=5,
        bytes=10,
        seconds=0.5,
        retries=0,
        resumed_from=0,
        epoch=rt.epoch,
        sealed=True,
        via="group",
    )
    rt.report(ReportKind.FIRST_STEP, step=6, epoch=rt.epoch)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with client.lock:
            if sum(1 for d in client.decoded if d.kind == Kind.REPORT) == 4:
                break
        time.sleep(0.01)
    rt.close()

    kinds = [d.kind for d in client.decoded]
    assert kinds[0] == Kind.STANDBY and Kind.HELLO in kinds and kinds[-1] == Kind.BYE
    standby = m.body_of(client.decoded[0], Standby)
    assert (standby.node, standby.local_rank) == ("c2", 0)
    hello = next(m.body_of(d, Hello) for d in client.decoded if d.kind == Kind.HELLO)
    assert (hello.rank, hello.epoch, hello.promoted) == (2, 4, True)
    reports = [Report.from_body(d.body) for d in client.decoded if d.kind == Kind.REPORT]
    assert [r.kind for r in reports] == [
        ReportKind.LIVE_READY,
        ReportKind.GROUP_REBUILT,
        ReportKind.TRANSFER_DONE,
        ReportKind.FIRST_STEP,
    ]
    assert all(r.rank == 2 and r.epoch == 4 for r in reports)
    assert reports[2].fields["via"] == "group" and reports[2].data.extra == {}
