"""A drained rank's handover against an outsider on the rendezvous store (issue 22).

The store is torch's open TCPStore on 127.0.0.1, standing for a store an outsider can
read and write (under tp run the job's store admits only holders of the secret:
``tests/unit/control/test_store_attacks.py``), so that these tests hold the listener's own
checks, the second line. The donor is a real :class:`LeavingDonor`; the attacker holds
everything the store holds and no job secret. In every case the legitimate spare gets the
donor's own shards, or a clear refusal, never the attacker's.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torchpass_slurm.errors import TransferError  # noqa: E402
from torchpass_slurm.rank.handover import DONOR_KEY, LeavingDonor, connect_to_leaving  # noqa: E402
from torchpass_slurm.rank.rendezvous import make_tcp_store  # noqa: E402
from torchpass_slurm.transfer import SocketListener, SocketTransport, recv_state  # noqa: E402
from torchpass_slurm.transfer.seal import CHALLENGE_BYTES, Seal  # noqa: E402
from torchpass_slurm.transfer.socket_transport import MAX_PENDING  # noqa: E402

EPOCH, RANK = 4, 1
SECRET = bytes(range(32))
TIMEOUT = datetime.timedelta(seconds=20)


def seal() -> Seal:
    return Seal(SECRET, f"job 9 epoch {EPOCH} step 6 rank {RANK}->rank {RANK}")


def shards() -> dict[str, Any]:
    return {"model": {"w": torch.arange(256, dtype=torch.float32)}, "step": 6}


def open_store(addr: str, port: int, timeout: datetime.timedelta) -> Any:
    return make_tcp_store(addr, port, is_master=False, timeout=timeout)


def open_job_store(addr: str, port: int, timeout: datetime.timedelta) -> Any:
    from torchpass_slurm.rank.store import JobStore

    return JobStore(addr, port, SECRET, timeout)


def spare_runtime(port: int, opener: Any = open_store) -> Any:
    return SimpleNamespace(
        info=SimpleNamespace(store_addr="127.0.0.1", store_port=port),
        epoch=EPOCH,
        log=logging.getLogger("spare"),
        job_store=opener,
    )


class Donor(threading.Thread):
    """A leaving rank serving its shards in the background."""

    def __init__(self, port: int, timeout: datetime.timedelta = TIMEOUT, opener: Any = open_store) -> None:
        super().__init__(daemon=True)
        self.donor = LeavingDonor(RANK, EPOCH, "127.0.0.1", port, seal(), opener)
        self.timeout = timeout
        self.stats: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.stats = self.donor.serve(shards(), {"step": 6}, self.timeout)
        except BaseException as exc:  # read by the test
            self.error = exc


def published(store: Any) -> str:
    key = f"epoch{EPOCH}/{DONOR_KEY.format(rank=RANK)}"
    store.wait([key], TIMEOUT)
    return str(store.get(key).decode())


def receive(port: int, opener: Any = open_store) -> dict[str, Any]:
    transport = connect_to_leaving(spare_runtime(port, opener), RANK, seal(), TIMEOUT)
    try:
        got, _ = recv_state(transport, timeout=TIMEOUT, into=None, seal=seal())
    finally:
        transport.close()
    return got


@pytest.fixture
def store() -> Any:
    from ..gloo_ranks import free_port

    return make_tcp_store("127.0.0.1", free_port(), is_master=True, timeout=TIMEOUT)


def test_an_outsider_who_reads_the_address_gets_nothing_and_the_spare_gets_the_shards(store: Any) -> None:
    donor = Donor(store.port)
    donor.start()
    host, port, _tag = published(store).rsplit(":", 2)
    assert host == "127.0.0.1", "the listener must bind the job's address, not every interface"
    # The attacker connects first, reads the challenge and answers it without the key.
    thief = socket.create_connection((host, int(port)), timeout=5)
    assert len(thief.recv(CHALLENGE_BYTES)) == CHALLENGE_BYTES
    thief.sendall(b"\0" * CHALLENGE_BYTES)
    thief.settimeout(5)
    assert thief.recv(1 << 16) == b"", "the donor must hang up on a wrong answer, sending nothing"
    thief.close()
    got = receive(store.port)
    donor.join(10)
    assert donor.error is None and donor.stats is not None
    assert torch.equal(got["model"]["w"], shards()["model"]["w"])


def test_under_the_job_store_an_outsider_cannot_even_read_the_address() -> None:
    """tp run's store: the leaving rank's address is out of an outsider's reach altogether."""
    from tests.unit.gloo_ranks import job_store
    from torchpass_slurm.rank.store import JobStore, StoreUnavailable

    with job_store(SECRET) as server:
        donor = Donor(server.port, opener=open_job_store)
        donor.start()
        key = f"epoch{EPOCH}/{DONOR_KEY.format(rank=RANK)}"
        assert published(open_job_store("127.0.0.1", server.port, TIMEOUT))  # it is there
        thief = JobStore(
            "127.0.0.1", server.port, bytes(32), TIMEOUT, reply_slack=datetime.timedelta(seconds=1)
        )
        with pytest.raises(StoreUnavailable, match="did not answer"):
            thief.check([key])
        with pytest.raises(StoreUnavailable, match="did not answer"):
            thief.set(key, "127.0.0.1:1:" + "0" * 64)
        got = receive(server.port, open_job_store)
        donor.join(10)
    assert donor.error is None and donor.stats is not None
    assert torch.equal(got["model"]["w"], shards()["model"]["w"])


def test_an_address_rewritten_by_an_outsider_is_refused(store: Any) -> None:
    donor = Donor(store.port, datetime.timedelta(seconds=3))
    donor.start()
    real = published(store)
    _host, _port, tag = real.rsplit(":", 2)
    with SocketListener("127.0.0.1", 0) as evil:  # the attacker's own "donor"
        for forged in (f"127.0.0.1:{evil.port}:{tag}", f"127.0.0.1:{evil.port}:{'0' * 64}", "garbage"):
            store.set(f"epoch{EPOCH}/{DONOR_KEY.format(rank=RANK)}", forged)
            with pytest.raises(TransferError, match=r"does not carry the job.s seal|did not publish"):
                connect_to_leaving(spare_runtime(store.port), RANK, seal(), TIMEOUT)
    donor.join(10)
    assert isinstance(donor.error, TransferError), "nobody with the key connected: the donor times out"


def test_silent_and_flooding_connections_do_not_keep_the_spare_out(store: Any) -> None:
    donor = Donor(store.port)
    donor.start()
    host, port, _ = published(store).rsplit(":", 2)
    flood = [socket.create_connection((host, int(port)), timeout=5) for _ in range(4 * MAX_PENDING)]
    began = time.monotonic()
    got = receive(store.port)
    waited = time.monotonic() - began
    donor.join(10)
    for conn in flood:
        conn.close()
    assert donor.error is None
    assert torch.equal(got["model"]["w"], shards()["model"]["w"])
    assert waited < 5, f"the spare waited {waited:.1f} s behind {len(flood)} silent connections"


def test_a_listener_with_only_wrong_peers_times_out() -> None:
    with SocketListener("127.0.0.1", 0) as listener:

        def wrong() -> None:
            with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as conn:
                conn.recv(CHALLENGE_BYTES)
                conn.sendall(b"x" * CHALLENGE_BYTES)
                conn.recv(1)

        peers = [threading.Thread(target=wrong) for _ in range(3)]
        for p in peers:
            p.start()
        with pytest.raises(TransferError, match="no peer with the transfer's key"):
            listener.accept_sealed(seal(), datetime.timedelta(seconds=1.5))
        for p in peers:
            p.join(5)


def test_a_peer_with_another_transfers_seal_is_refused() -> None:
    with SocketListener("127.0.0.1", 0) as listener:
        other = Seal(SECRET, "job 9 epoch 3 step 6 rank 1->rank 1")
        result: list[Any] = []
        t = threading.Thread(
            target=lambda: result.append(
                SocketTransport.connect_sealed("127.0.0.1", listener.port, other, TIMEOUT)
            )
        )
        t.start()
        with pytest.raises(TransferError, match="no peer with the transfer's key"):
            listener.accept_sealed(seal(), datetime.timedelta(seconds=1.5))
        t.join(5)
        for transport in result:
            transport.close()
