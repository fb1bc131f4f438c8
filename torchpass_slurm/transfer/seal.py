"""Authenticate a state transfer with a key derived from the job's secret.

A :class:`Seal` turns the per-job secret and one transfer's context (the job,
the epoch, the step, donor and receiver) into that transfer's key, as the
control plane's CURVE keys are derived (``control/security.py``)::

    job transfer key = HMAC-SHA256(secret, "torchpass-slurm state transfer key v1")
    transfer key     = HMAC-SHA256(job transfer key, context)
    manifest MAC     = HMAC-SHA256(transfer key, "manifest" || manifest bytes)       32 bytes
    chunk MAC        = HMAC-SHA256(transfer key, "chunk" || u64 index || chunk)[:16]

The manifest fixes every chunk's place and size, and each chunk's MAC binds
its index, so a holder of no secret can neither forge, reorder nor cut a
stream, and a stream recorded in another epoch or for another receiver does
not verify here. A donor's published address carries :meth:`Seal.tag` of it,
and a receiver proves it holds the key by answering a donor's challenge with
:meth:`Seal.answer`. The wire is not encrypted: an eavesdropper on the job's
network can read the weights, not change them (``docs/security.md``).

HMAC-SHA256 runs at about the wire's speed with SHA extensions; the cost
against crc32 is measured by ``benchmarks/transfer_bench.py --seal``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import struct

from torchpass_slurm.errors import TransferError

__all__ = [
    "Seal",
    "check_sealing",
    "SEALED_DIGEST",
    "MANIFEST_MAC_BYTES",
    "CHUNK_MAC_BYTES",
    "CHALLENGE_BYTES",
]

logger = logging.getLogger(__name__)

#: The manifest's ``digest_algo`` of a sealed stream: every chunk digest is a chunk MAC.
SEALED_DIGEST = "hmac-sha256-128"
MANIFEST_MAC_BYTES = 32
CHUNK_MAC_BYTES = 16
#: Bytes of a donor's challenge, and of the receiver's answer.
CHALLENGE_BYTES = 16
_LABEL = b"torchpass-slurm state transfer key v1"
_INDEX = struct.Struct("<Q")


class Seal:
    """The key of one state transfer; both ends build it from the same secret and context."""

    __slots__ = ("_key", "context")

    def __init__(self, secret: bytes, context: str) -> None:
        if len(secret) < 16:
            raise ValueError("a transfer seal needs the job's secret (at least 16 bytes)")
        job_key = hmac.new(secret, _LABEL, hashlib.sha256).digest()
        self.context = context
        self._key = hmac.new(job_key, context.encode(), hashlib.sha256).digest()

    def __repr__(self) -> str:  # never print a key
        return f"Seal(context={self.context!r})"

    def manifest_mac(self, raw: bytes) -> bytes:
        return self._mac(b"manifest", raw)

    def chunk_mac(self, index: int, data: memoryview) -> bytes:
        mac = hmac.new(self._key, b"chunk" + _INDEX.pack(index), "sha256")
        mac.update(data)  # large buffers: hashed without the GIL
        return mac.digest()[:CHUNK_MAC_BYTES]

    def tag(self, text: str) -> str:
        """A hex tag of ``text`` (a published address), checked with :meth:`check_tag`."""
        return self._mac(b"tag", text.encode()).hex()

    def check_tag(self, text: str, tag: str) -> bool:
        return hmac.compare_digest(self.tag(text), tag)

    def answer(self, challenge: bytes) -> bytes:
        """The receiver's proof that it holds this transfer's key."""
        return self._mac(b"answer", challenge)[:CHALLENGE_BYTES]

    def check_answer(self, challenge: bytes, answer: bytes) -> bool:
        return hmac.compare_digest(self.answer(challenge), answer)

    def check_manifest(self, raw: bytes, mac: bytes) -> None:
        """TransferError (logged) unless ``mac`` is this transfer's MAC of the manifest ``raw``."""
        if not hmac.compare_digest(self.manifest_mac(raw), mac):
            logger.warning("refused a state manifest whose MAC does not verify (%s)", self.context)
            raise TransferError(
                "the state manifest failed its MAC: it was not sealed with this job's key for this "
                f"transfer ({self.context})",
                hint="a forged donor, or a stream of another transfer replayed",
            )

    def _mac(self, label: bytes, data: bytes) -> bytes:
        return hmac.new(self._key, label + data, hashlib.sha256).digest()


def check_sealing(sealed: bool, seal: Seal | None) -> None:
    """TransferError unless a stream's header (``sealed``) matches the receiver's ``seal``."""
    if seal is not None and not sealed:
        logger.warning("refused an unsealed state stream: this receiver takes only sealed states")
        raise TransferError(
            "the donor sent an unsealed state; this receiver accepts only a state sealed with the job's key",
            hint="a peer without the job's secret, or a donor of another torchpass-slurm version",
        )
    if seal is None and sealed:
        raise TransferError(
            "the donor sent a sealed state but this receiver holds no key to check it",
            hint="pass the same seal to recv_state as the donor passed to send_state",
        )
