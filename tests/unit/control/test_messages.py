"""encode/decode: the MAC, the checks, and what each rejection says."""

from __future__ import annotations

import json

import pytest

from torchpass_slurm.control import messages as m
from torchpass_slurm.errors import AuthenticationError, ControlPlaneError

SECRET = bytes(range(32))
NOW = 1_700_000_000.0
HELLO_BODY = {"node": "n1", "rank": 0, "local_rank": 0, "role": "active", "pid": 42}


def hello(seq: int = 1, ts: float = NOW, **body: object) -> m.Message:
    return m.Message(m.HELLO, "n1/0", seq, ts, {**HELLO_BODY, **body})


def decode(frames: list[bytes], **kw: object) -> m.Message:
    kw.setdefault("now", NOW)
    return m.decode(frames, SECRET, **kw)  # type: ignore[arg-type]


def resign(payload: bytes) -> list[bytes]:
    """Frames with a valid MAC around an arbitrary payload (an insider's bug)."""
    return [m.PROTOCOL_VERSION, payload, m._mac(SECRET, m.PROTOCOL_VERSION, payload)]


def test_round_trip() -> None:
    msg = hello(extra=[1, "x"])
    assert decode(m.encode(msg, SECRET)) == msg


def test_payload_is_canonical_json() -> None:
    frames = m.encode(hello(), SECRET)
    assert frames[1] == json.dumps(json.loads(frames[1]), sort_keys=True, separators=(",", ":")).encode()
    assert len(frames[2]) == m.MAC_BYTES


@pytest.mark.parametrize("part", [1, 2])
def test_any_flipped_byte_fails_the_mac(part: int) -> None:
    frames = m.encode(hello(), SECRET)
    frames[part] = bytes([frames[part][0] ^ 1]) + frames[part][1:]
    with pytest.raises((AuthenticationError, ControlPlaneError)):
        decode(frames)


def test_wrong_secret_is_an_authentication_error_that_leaks_nothing() -> None:
    frames = m.encode(hello(), b"k" * 32)
    with pytest.raises(AuthenticationError, match="HMAC") as info:
        decode(frames)
    text = str(info.value)
    assert SECRET.hex() not in text and frames[2].hex() not in text


def test_tampered_body_with_old_mac_is_rejected() -> None:
    frames = m.encode(hello(), SECRET)
    frames[1] = frames[1].replace(b'"rank":0', b'"rank":1')
    with pytest.raises(AuthenticationError):
        decode(frames)


def test_replay_is_rejected_by_the_guard() -> None:
    guard = m.ReplayGuard()
    frames = m.encode(hello(seq=5), SECRET)
    decode(frames, guard=guard)
    with pytest.raises(AuthenticationError, match="replayed"):
        decode(frames, guard=guard)
    with pytest.raises(AuthenticationError, match="seq 4 is not above"):
        decode(m.encode(hello(seq=4), SECRET), guard=guard)
    assert decode(m.encode(hello(seq=6), SECRET), guard=guard).seq == 6
    assert guard.last_seq("n1/0") == 6


def test_guard_is_not_advanced_by_a_rejected_message() -> None:
    guard = m.ReplayGuard()
    with pytest.raises(AuthenticationError):
        decode(m.encode(hello(seq=9, ts=NOW - 3600), SECRET), guard=guard)
    assert guard.last_seq("n1/0") is None


@pytest.mark.parametrize("offset", [-31.0, 31.0, -86400.0])
def test_timestamp_outside_the_window_is_rejected(offset: float) -> None:
    with pytest.raises(AuthenticationError, match="window"):
        decode(m.encode(hello(ts=NOW + offset), SECRET))


def test_timestamp_inside_the_window_is_accepted() -> None:
    assert decode(m.encode(hello(ts=NOW - 5), SECRET), max_skew_s=10).ts == NOW - 5


def test_kind_not_allowed_at_this_end() -> None:
    frames = m.encode(hello(), SECRET)
    with pytest.raises(ControlPlaneError, match="not accepted here"):
        decode(frames, allowed=m.SUPERVISOR_KINDS)


def test_encode_refuses_unknown_kind_and_bad_bodies() -> None:
    with pytest.raises(ControlPlaneError, match="unknown control message kind"):
        m.encode(m.Message("reboot", "n1/0", 1, NOW, {}), SECRET)
    with pytest.raises(ControlPlaneError, match="lacks the field 'pid'"):
        no_pid = {k: v for k, v in HELLO_BODY.items() if k != "pid"}
        m.encode(m.Message(m.HELLO, "n1/0", 1, NOW, no_pid), SECRET)
    with pytest.raises(ControlPlaneError, match="not plain JSON"):
        m.encode(hello(blob=object()), SECRET)
    with pytest.raises(ControlPlaneError, match="limit"):
        m.encode(hello(blob="x" * m.MAX_FRAME_BYTES), SECRET)


@pytest.mark.parametrize(
    "frames, match",
    [
        ([b"tp3", b"{}"], "2 frame"),
        ([b"tp9", b"{}", b"\0" * 32], "protocol version"),
        ([b"tp3", b"{}", b"\0" * 31], "MAC is 31 bytes"),
        ([b"tp3", b"x" * (m.MAX_FRAME_BYTES + 1), b"\0" * 32], "limit"),
    ],
)
def test_malformed_frames(frames: list[bytes], match: str) -> None:
    with pytest.raises(ControlPlaneError, match=match) as info:
        decode(frames)
    assert not isinstance(info.value, AuthenticationError)


def _payload(**override: object) -> bytes:
    obj = {
        "body": HELLO_BODY,
        "kind": "hello",
        "sender": "n1/0",
        "seq": 1,
        "to": "supervisor",
        "ts": NOW,
        **override,
    }
    return json.dumps(obj).encode()


@pytest.mark.parametrize(
    "payload, match",
    [
        (b"not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "fields list"),
        (_payload(extra=1), "fields"),
        (_payload(kind="reboot"), "unknown control message kind"),
        (_payload(sender=""), "sender"),
        (_payload(seq="1"), "seq"),
        (_payload(seq=True), "seq"),
        (_payload(seq=-1), "seq"),
        (_payload(ts="now"), "ts"),
        (b'{"body":{},"kind":"hello","sender":"a","seq":1,"to":"supervisor","ts":NaN}', "ts"),
        (_payload(body=[1]), "body is a list"),
        (_payload(body={**HELLO_BODY, "pid": "42"}), "'pid' is str; expected int"),
        (_payload(body={**HELLO_BODY, "rank": False}), "'rank' is bool"),
    ],
)
def test_authentic_but_malformed_payloads(payload: bytes, match: str) -> None:
    with pytest.raises(ControlPlaneError, match=match) as info:
        decode(resign(payload))
    assert not isinstance(info.value, AuthenticationError)


def test_optional_fields_accept_null() -> None:
    msg = m.Message(m.HEARTBEAT, "s1/0", 1, NOW, {"rank": None, "step": None, "state": "standby"})
    assert decode(m.encode(msg, SECRET)).body["rank"] is None


def test_short_secret_is_refused() -> None:
    with pytest.raises(ControlPlaneError, match="16 bytes"):
        m.encode(hello(), b"short")


def test_sequence_counter_starts_from_the_clock_and_grows() -> None:
    a, b = m.SequenceCounter(), m.SequenceCounter(start=7)
    first = a.next()
    assert first > 1_600_000_000 * 10**6 and a.next() == first + 1
    assert (b.next(), b.next()) == (7, 8)
