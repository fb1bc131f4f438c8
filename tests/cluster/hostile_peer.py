"""A hostile peer on the cluster's network, for test_hostile_network.py (runs on a node outside the job).

    python3 /src/tests/cluster/hostile_peer.py HOST PORT SECONDS [--store]

For SECONDS it sends what an attacker without the job's secret can: random
bytes, truncated ZMTP greetings, 2**63-byte length headers, control messages
forged with a random secret (over plain ZMTP and over CURVE with made-up
keys), DEALERs claiming the routing ids the ROUTER hands out first, and bursts
of 200 connections held open for a second. With ``--store`` (PORT is then the
job's rendezvous store) it also speaks torch's TCPStore protocol, as a client
of the store torch would have hosted: it poisons and inflates the count-in
and rewrites gloo's addresses of the next epochs. Prints what it sent as JSON.
Nothing it sends can be signed with the job's secret: it never reads it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import sys
import time


def greeting(mechanism: bytes) -> bytes:
    return b"\xff" + b"\0" * 8 + b"\x7f\x03\x00" + mechanism.ljust(20, b"\0") + b"\0" * 32


def forged(secret: bytes) -> list[bytes]:
    payload = json.dumps(
        {
            "body": {"reason": "forged"},
            "kind": "stop",
            "sender": "supervisor",
            "seq": time.time_ns(),
            "to": "c1/0",
            "ts": time.time(),
        }
    ).encode()
    mac = hmac.new(secret, b"torchpass-slurm control plane\0tp3\0" + payload, hashlib.sha256).digest()
    return [b"tp3", payload, mac]


def raw_round(host: str, port: int, counts: dict[str, int]) -> None:
    for data in (
        os.urandom(4096),
        greeting(b"CURVE")[:30],
        greeting(b"NULL") + b"\x06" + b"\xff" * 8,
        greeting(b"CURVE") + b"\x02" + (2**63 - 1).to_bytes(8, "big"),
    ):
        try:
            with socket.create_connection((host, port), timeout=2) as s:
                s.sendall(data)
            counts["raw"] += 1
        except OSError:
            counts["raw_failed"] += 1
    burst = []
    for _ in range(200):
        try:
            burst.append(socket.create_connection((host, port), timeout=2))
        except OSError:
            counts["flood_failed"] += 1
    counts["flood"] += len(burst)
    time.sleep(1.0)
    for s in burst:
        s.close()


def zmq_round(host: str, port: int, counts: dict[str, int]) -> None:
    try:
        import zmq
    except ImportError:
        return
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)
    socks = []
    for k in range(8):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(
            zmq.ROUTING_ID, b"\0" + (0x6B8B4567 + k).to_bytes(4, "big")
        )  # glibc rand() after srand(1)
        if k % 2:
            server_pk, _ = zmq.curve_keypair()
            pk, sk = zmq.curve_keypair()
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_pk, pk, sk
        sock.connect(f"tcp://{host}:{port}")
        sock.send_multipart(forged(os.urandom(32)), flags=zmq.NOBLOCK)
        socks.append(sock)
        counts["forged"] += 1
    time.sleep(0.5)
    ctx.destroy(linger=0)


def store_round(host: str, port: int, counts: dict[str, int]) -> None:
    """torch's TCPStore client writing the keys that decide a rendezvous (all refused)."""
    import datetime

    import torch.distributed as dist

    for epoch in range(4):
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=1))
            store.set(f"epoch{epoch}/torchpass/joined", "garbage")
            store.add(f"epoch{epoch}/torchpass/joined", 1)
            store.set(f"epoch{epoch}/0//cpu//0/0", os.urandom(64))
            counts["store_written"] += 1  # must stay 0: the test asserts it
        except Exception:
            counts["store_refused"] += 1


def main(host: str, port: str, seconds: str, *mode: str) -> None:
    names = ("raw", "raw_failed", "flood", "flood_failed", "forged", "store_written", "store_refused")
    counts = {k: 0 for k in names}
    end = time.monotonic() + float(seconds)
    while time.monotonic() < end:
        raw_round(host, int(port), counts)
        zmq_round(host, int(port), counts)
        if "--store" in mode:
            store_round(host, int(port), counts)
    print(json.dumps(counts))


if __name__ == "__main__":
    main(*sys.argv[1:])
