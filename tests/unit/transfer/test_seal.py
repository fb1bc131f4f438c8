"""A sealed state stream against an attacker without the job's key (issue 22), in process.

The attacker sits where the rendezvous store let it sit: it relays the real
donor's stream (metadata and MACs included) and changes the weights, or it
replays a stream of another transfer, or it sends its own. The receiver must
refuse every one with a TransferError, tell the donor, and report why.
"""

from __future__ import annotations

import logging
import queue
import struct
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tests.unit.transfer.fakes import REJECTED, QueueTransport, ScriptedDonor, queue_pair  # noqa: E402
from torchpass_slurm.errors import TransferError  # noqa: E402
from torchpass_slurm.transfer.chunks import FLAG_SEALED, pack_header  # noqa: E402
from torchpass_slurm.transfer.manifest import build_manifest  # noqa: E402
from torchpass_slurm.transfer.seal import CHUNK_MAC_BYTES, SEALED_DIGEST, Seal  # noqa: E402
from torchpass_slurm.transfer.stream import recv_state, send_state  # noqa: E402

TIMEOUT = timedelta(seconds=5)
SECRET = bytes(range(32))
CONTEXT = "job 7 epoch 3 step 12 rank 1->rank 4"
CHUNK = 64  # bytes: 16 float32 weights a chunk


def weights() -> dict[str, Any]:
    return {"model": {"w": torch.arange(64, dtype=torch.float32)}, "step": 12}


def fresh() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(64, dtype=torch.float32)}, "step": 0}


Tamper = Callable[[bytes], bytes]


def relay(src: QueueTransport, dst: QueueTransport, tamper: Tamper, stop: threading.Event) -> None:
    """Forward every message from ``src``'s peer to ``dst``'s peer, through ``tamper``."""
    while not stop.is_set():
        try:
            data = src.inbox.get(timeout=0.05)
        except queue.Empty:
            continue
        dst.outbox.put(tamper(data))


def plus_1000(data: bytes) -> bytes:
    """The attacker's edit: 1000 added to every weight of a chunk; everything else as sent."""
    if len(data) != CHUNK:
        return data
    values = struct.unpack(f"<{CHUNK // 4}f", data)
    return struct.pack(f"<{CHUNK // 4}f", *(v + 1000 for v in values))


def run(
    send_seal: Seal | None, recv_seal: Seal | None, tamper: Tamper | None = None
) -> tuple[dict[str, Any], list[BaseException], BaseException | None]:
    """Donor thread -> (attacker relay) -> receiver; (what the receiver holds, donor errors, its error)."""
    donor_end, receiver_end = queue_pair()
    stop = threading.Event()
    threads = []
    if tamper is not None:  # the attacker between them, both directions
        donor_end, attacker_near_donor = queue_pair()
        attacker_near_recv, receiver_end = queue_pair()
        threads += [
            threading.Thread(target=relay, args=(attacker_near_donor, attacker_near_recv, tamper, stop)),
            threading.Thread(target=relay, args=(attacker_near_recv, attacker_near_donor, lambda d: d, stop)),
        ]
    errors: list[BaseException] = []

    def donor() -> None:
        try:
            send_state(donor_end, weights(), timeout=TIMEOUT, chunk_bytes=CHUNK, seal=send_seal)
        except BaseException as exc:  # reported to the test
            errors.append(exc)

    threads.append(threading.Thread(target=donor))
    for t in threads:
        t.start()
    into, failure = fresh(), None
    try:
        recv_state(receiver_end, timeout=TIMEOUT, into=into, seal=recv_seal)
    except TransferError as exc:
        failure = exc
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    return into, errors, failure


def test_a_sealed_state_arrives_bitwise() -> None:
    into, errors, failure = run(Seal(SECRET, CONTEXT), Seal(SECRET, CONTEXT))
    assert failure is None and not errors
    assert torch.equal(into["model"]["w"], weights()["model"]["w"])


def test_the_chunk_digests_of_a_sealed_stream_are_macs() -> None:
    seal = Seal(SECRET, CONTEXT)
    data = memoryview(bytes(range(64)))
    assert len(seal.chunk_mac(0, data)) == CHUNK_MAC_BYTES
    assert seal.chunk_mac(0, data) != seal.chunk_mac(1, data), "a MAC must bind the chunk's index"
    assert seal.chunk_mac(0, data) != Seal(SECRET, CONTEXT + "x").chunk_mac(0, data)
    assert repr(seal) == f"Seal(context={CONTEXT!r})", "a seal's repr must not show its key"


def test_weights_changed_on_the_way_are_refused(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    _, errors, failure = run(Seal(SECRET, CONTEXT), Seal(SECRET, CONTEXT), tamper=plus_1000)
    assert isinstance(failure, TransferError)
    assert "failed their digest" in str(failure)
    assert errors and "gave up" in str(errors[0]), "the donor must learn that the receiver gave up"
    assert "failed its hmac-sha256-128 digest" in caplog.text


def test_an_unsealed_stream_is_refused_by_a_sealed_receiver() -> None:
    into, errors, failure = run(None, Seal(SECRET, CONTEXT))
    assert failure is not None and "unsealed state" in str(failure)
    assert errors and "rejected" in str(errors[0])
    assert torch.equal(into["model"]["w"], fresh()["model"]["w"]), "nothing may be written"


def test_a_stream_sealed_with_another_secret_is_refused() -> None:
    into, errors, failure = run(Seal(bytes(32), CONTEXT), Seal(SECRET, CONTEXT))
    assert failure is not None and "failed its MAC" in str(failure)
    assert errors and "rejected" in str(errors[0])
    assert torch.equal(into["model"]["w"], fresh()["model"]["w"])


def test_a_stream_of_another_transfer_replayed_is_refused() -> None:
    into, _, failure = run(Seal(SECRET, "job 7 epoch 2 step 9 rank 1->rank 4"), Seal(SECRET, CONTEXT))
    assert failure is not None and "failed its MAC" in str(failure)
    assert torch.equal(into["model"]["w"], fresh()["model"]["w"])


def test_a_sealed_stream_to_a_receiver_without_a_key_is_refused() -> None:
    _, errors, failure = run(Seal(SECRET, CONTEXT), None)
    assert failure is not None and "holds no key" in str(failure)
    assert errors and "rejected" in str(errors[0])


def test_a_manifest_naming_the_sealed_digest_without_the_flag_is_refused() -> None:
    """An attacker cannot make an unsealed receiver expect MACs it can compute (or skip them)."""
    manifest, _ = build_manifest(weights(), chunk_bytes=CHUNK, digest_algo=SEALED_DIGEST)
    raw = manifest.to_json()
    donor = ScriptedDonor(bytes(pack_header(len(raw)).numpy()), raw)
    with pytest.raises(TransferError, match="does not match the stream's unsealed header"):
        recv_state(donor, timeout=TIMEOUT, into=fresh())
    assert donor.sent == [REJECTED]


def test_a_truncated_manifest_mac_is_refused() -> None:
    manifest, _ = build_manifest(weights(), chunk_bytes=CHUNK, digest_algo=SEALED_DIGEST)
    raw = manifest.to_json()
    mac = Seal(SECRET, CONTEXT).manifest_mac(raw)
    bad = raw + mac[:-1] + bytes([mac[-1] ^ 1])
    donor = ScriptedDonor(bytes(pack_header(len(raw), FLAG_SEALED).numpy()), bad)
    with pytest.raises(TransferError, match="failed its MAC"):
        recv_state(donor, timeout=TIMEOUT, into=fresh(), seal=Seal(SECRET, CONTEXT))
    assert donor.sent == [REJECTED]


def test_unknown_header_flags_are_refused() -> None:
    raw = b"{}"
    donor = ScriptedDonor(bytes(pack_header(len(raw), 0x80).numpy()), raw)
    with pytest.raises(TransferError, match="unknown flags 0x0080"):
        recv_state(donor, timeout=TIMEOUT, into=fresh())
    assert donor.sent == [REJECTED]
