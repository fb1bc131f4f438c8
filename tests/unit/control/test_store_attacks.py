"""The job's rendezvous store against outsiders on loopback (issue 22).

The store is the real one, in its own process as ``tp run`` hosts it
(:class:`~torchpass_slurm.supervisor.store_host.StoreHost`); the ranks are real gloo
ranks (spawned processes) that build their group through
:class:`~torchpass_slurm.rank.store.JobStore` and all-reduce. The attackers:
raw TCP floods (1,100 and 10,000 connections), torch's own TCPStore client
(what used to read and write every key), CURVE clients with another job's
secret trying to poison the count-in or rewrite gloo's addresses, and a holder
of the secret sending malformed frames. During every attack the legitimate
group forms and reduces the right numbers, the store lives, and this process
(standing for the supervisor) lives.
"""

from __future__ import annotations

import datetime
import multiprocessing
import resource
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

torch = pytest.importorskip("torch")

from torchpass_slurm.control.secret import create_secret, load_secret  # noqa: E402
from torchpass_slurm.control.security import derive_keys, make_curve_client  # noqa: E402
from torchpass_slurm.rank.rendezvous import make_tcp_store  # noqa: E402
from torchpass_slurm.rank.store import JobStore, StoreUnavailable  # noqa: E402
from torchpass_slurm.supervisor.store_host import StoreHost  # noqa: E402

WORLD = 3
SHORT = datetime.timedelta(seconds=2)
GROUP_TIMEOUT = datetime.timedelta(seconds=60)
#: How long a legitimate client may take for one round trip after a flood.
AFTER_FLOOD_S = 5.0


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    return create_secret(tmp_path)


@pytest.fixture
def store(secret_file: Path) -> Iterator[StoreHost]:
    host = StoreHost.start("127.0.0.1", secret_file, datetime.timedelta(seconds=60))
    yield host
    host.close()


def rank_main(rank: int, port: int, secret_file: str, epoch: int, out: Any) -> None:
    """One legitimate rank: count in, build the epoch's gloo group, all-reduce its rank + 1."""
    import torch.distributed as dist

    from torchpass_slurm.control.secret import load_secret
    from torchpass_slurm.rank.store import JobStore

    started = time.monotonic()
    client = JobStore("127.0.0.1", port, load_secret(Path(secret_file)), GROUP_TIMEOUT)
    store = dist.PrefixStore(f"epoch{epoch}", client)
    store.add("torchpass/joined", 1)
    while store.add("torchpass/joined", 0) < WORLD:
        time.sleep(0.05)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=GROUP_TIMEOUT)
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    dist.destroy_process_group()
    out.put((rank, float(value.item()), time.monotonic() - started))


def legitimate_group(port: int, secret_file: Path, epoch: int = 0) -> list[tuple[int, float, float]]:
    """WORLD ranks meet in the store and all-reduce; (rank, sum, seconds) of each, all asserted."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=rank_main, args=(r, port, str(secret_file), epoch, out)) for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(GROUP_TIMEOUT.total_seconds() + 30)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert [p.exitcode for p in procs] == [0] * WORLD
    results = sorted(out.get(timeout=5) for _ in range(WORLD))
    assert [(r, total) for r, total, _ in results] == [
        (r, float(sum(range(1, WORLD + 1)))) for r in range(WORLD)
    ]
    return results


def round_trip_s(port: int, secret_file: Path) -> float:
    client = JobStore("127.0.0.1", port, load_secret(secret_file), SHORT)
    started = time.monotonic()
    client.set("probe", b"v")
    assert client.get("probe") == b"v"
    took = time.monotonic() - started
    client.close()
    return took


def outsider(port: int, timeout: datetime.timedelta = SHORT) -> JobStore:
    """A CURVE client of the job's store with another job's secret."""
    return JobStore(
        "127.0.0.1", port, secrets.token_bytes(32), timeout, reply_slack=datetime.timedelta(seconds=1)
    )


# --- who can reach the store ----------------------------------------------------------------


def test_the_store_listens_on_the_jobs_address_only(store: StoreHost) -> None:
    with open("/proc/net/tcp") as f:
        listening = [line.split()[1] for line in f.readlines()[1:] if line.split()[3] == "0A"]
    ours = [addr for addr in listening if int(addr.split(":")[1], 16) == store.port]
    assert ours == ["0100007F:" + f"{store.port:04X}"], ours  # 127.0.0.1 only, not 0.0.0.0


def test_torchs_store_client_neither_reads_nor_writes(store: StoreHost, secret_file: Path) -> None:
    with pytest.raises(RuntimeError):
        client = make_tcp_store("127.0.0.1", store.port, is_master=False, timeout=SHORT)
        client.set("epoch0/torchpass/joined", "999")
    legitimate_group(store.port, secret_file)
    assert store.alive()


def test_another_jobs_secret_can_neither_poison_nor_inflate_the_count_in(
    store: StoreHost, secret_file: Path
) -> None:
    evil = outsider(store.port)
    for attack in (
        lambda: evil.set("epoch0/torchpass/joined", b"garbage"),  # poisoned
        lambda: evil.add("epoch0/torchpass/joined", 1),  # inflated: would pass with a rank missing
        lambda: evil.get("epoch0/torchpass/joined"),
    ):
        with pytest.raises(StoreUnavailable, match="did not answer"):
            attack()
    legitimate_group(store.port, secret_file)
    reader = JobStore("127.0.0.1", store.port, load_secret(secret_file), SHORT)
    assert reader.add("epoch0/torchpass/joined", 0) == WORLD  # every rank once, nobody else
    assert store.alive()


def test_another_jobs_secret_cannot_rewrite_gloos_addresses(store: StoreHost, secret_file: Path) -> None:
    legitimate_group(store.port, secret_file, epoch=0)
    reader = JobStore("127.0.0.1", store.port, load_secret(secret_file), SHORT)
    keys = [f"epoch0/0//cpu//0/{r}" for r in range(WORLD)]  # each rank's address (torch 2.13's gloo)
    assert reader.check(keys), "gloo's pair addresses are not where this test looks for them"
    before = {k: reader.get(k) for k in keys}
    evil = outsider(store.port)
    for key in [*keys, "epoch1/0//cpu//0/0"]:
        with pytest.raises(StoreUnavailable):
            evil.set(key, b"\x00" * 64)  # a redirect to the attacker's listener
    assert {k: reader.get(k) for k in keys} == before
    legitimate_group(store.port, secret_file, epoch=1)  # the next epoch meets untouched


# --- floods ---------------------------------------------------------------------------------


@pytest.mark.parametrize("connections", [1_100, 10_000])
def test_a_flood_of_idle_connections_leaves_the_rendezvous_and_the_supervisor_alive(
    store: StoreHost, secret_file: Path, connections: int
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < connections + 512:
        pytest.skip(f"this host allows {hard} open files; the flood needs {connections + 512}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, connections + 512), hard))
    flood: list[socket.socket] = []
    began = time.monotonic()
    try:
        for _ in range(connections):  # as fast as the kernel takes them: non-blocking connects
            conn = socket.socket()
            conn.setblocking(False)
            flood.append(conn)
            conn.connect_ex(("127.0.0.1", store.port))
        time.sleep(1)  # let them land
        connected = sum(1 for c in flood if c.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0)
        assert connected >= connections // 2, f"only {connected} of {connections} connected"
        flooded = time.monotonic()
        group = legitimate_group(store.port, secret_file)  # during the flood, its sockets held open
        print(
            f"{connections} connections opened in {flooded - began:.1f} s; the group met "
            f"and reduced in {max(s for _, _, s in group):.2f} s during the flood"
        )
        assert store.alive(), "the store died of the flood"
    finally:
        for conn in flood:
            conn.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    took = round_trip_s(store.port, secret_file)
    assert took < AFTER_FLOOD_S, f"a rank waited {took:.1f} s after the flood (torch's store: ~105 s)"
    assert store.alive()


# --- a holder of the secret sending junk ----------------------------------------------------


def test_malformed_requests_from_a_holder_of_the_secret_are_refused_and_the_store_serves_on(
    store: StoreHost, secret_file: Path
) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    make_curve_client(sock, derive_keys(load_secret(secret_file), plane="store"))
    sock.connect(f"tcp://127.0.0.1:{store.port}")
    rid = (7).to_bytes(8, "big")
    junk: list[list[bytes]] = [
        [b"short"],
        [rid, b"Z"],  # unknown op
        [rid, b"S", b"k"],  # set without a value
        [rid, b"S", b"", b"v"],  # empty key
        [rid, b"S", b"k" * 5000, b"v"],  # a key over the limit
        [rid, b"G", b"k", b"-5"],  # negative timeout
        [rid, b"A", b"k", b"1e9"],  # not an integer
        [rid, b"A", b"k", b"9" * 40],
        [rid, b"W", b"100"],  # a wait for no key
        [rid, b"N", b"extra"],
    ]
    try:
        for frames in junk:
            sock.send_multipart(frames)
            assert sock.poll(5000), f"no answer to {frames!r}"
            reply = sock.recv_multipart()
            assert reply[1] == b"error", (frames, reply)
        sock.send_multipart([rid, b"S", b"counter", b"not a number"])
        assert sock.poll(5000) and sock.recv_multipart()[1] == b"ok"
        sock.send_multipart([rid, b"A", b"counter", b"1"])
        assert sock.poll(5000)
        reply = sock.recv_multipart()
        assert reply[1] == b"error" and b"not a counter" in reply[2]
    finally:
        sock.close()
        ctx.term()
    assert store.alive()
    assert round_trip_s(store.port, secret_file) < AFTER_FLOOD_S
