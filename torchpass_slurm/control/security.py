"""Transport security of the control plane: CURVE keys from the job's secret, socket limits.

Every control-plane socket runs ZeroMQ's CURVE mechanism (CurveZMQ: Curve25519
key exchange, then every frame encrypted and authenticated). The keys are
never stored or sent: the supervisor and every rank derive them from the
per-job secret (:mod:`~torchpass_slurm.control.secret`)::

    server secret key = HMAC-SHA256(secret, "torchpass-slurm curve25519 server key v1")
    client secret key = HMAC-SHA256(secret, "torchpass-slurm curve25519 client key v1")
    public key        = Curve25519(secret key)             (zmq.curve_public)

The job's rendezvous store (:mod:`~torchpass_slurm.control.store_server`) is
a second CURVE server with key pairs of its own: the same labels with
``" store"`` appended, so that neither server's key opens the other.

One client key pair serves every rank of the job. A peer that does not hold
the secret cannot finish the handshake: it knows neither the server's public
key (which CurveZMQ needs to open its first box) nor the client key the
server's ZAP handler (:mod:`~torchpass_slurm.control.gate`) admits. So it
never reaches the ROUTER's routing table, and its bytes never reach
:func:`~torchpass_slurm.control.messages.decode`. The HMAC inside each
message stays: it names the sender, carries the replay guard and keeps the
messages checkable without zmq (the supervisor's tests, the fakes).

:class:`SocketLimits` holds the timeouts and budgets every socket gets; see
``docs/security.md`` for why each value is what it is.
"""

from __future__ import annotations

import hashlib
import hmac
import resource
from dataclasses import dataclass
from datetime import timedelta

import zmq
from zmq.utils import z85

__all__ = [
    "CurveKeys",
    "PLANES",
    "SocketLimits",
    "DEFAULT_LIMITS",
    "ZAP_DOMAIN",
    "derive_keys",
    "apply_limits",
    "make_curve_server",
    "make_curve_client",
    "raise_fd_limit",
]

#: The ZAP domain of the control plane's server socket.
ZAP_DOMAIN = "torchpass"
_SERVER_LABEL = b"torchpass-slurm curve25519 server key v1"
_CLIENT_LABEL = b"torchpass-slurm curve25519 client key v1"


@dataclass(frozen=True)
class CurveKeys:
    """The job's two CURVE key pairs, each key Z85-encoded (40 ASCII bytes) as zmq wants it."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    def __repr__(self) -> str:  # never print a secret key
        return f"CurveKeys(server_public={self.server_public!r}, client_public={self.client_public!r})"


#: The servers of a job, each with key pairs of its own: the control plane and the rendezvous store.
PLANES = ("control", "store")


def derive_keys(secret: bytes, plane: str = "control") -> CurveKeys:
    """The key pairs of ``plane`` (one of :data:`PLANES`), derived from the per-job ``secret``
    (deterministic, no I/O)."""
    if plane not in PLANES:
        raise ValueError(f"unknown plane {plane!r}; the planes are {', '.join(PLANES)}")
    suffix = b"" if plane == "control" else b" " + plane.encode("ascii")
    server = _secret_key(secret, _SERVER_LABEL + suffix)
    client = _secret_key(secret, _CLIENT_LABEL + suffix)
    return CurveKeys(zmq.curve_public(server), server, zmq.curve_public(client), client)


def _secret_key(secret: bytes, label: bytes) -> bytes:
    # Curve25519 takes any 32 bytes as a secret key (the scalar is clamped when used).
    return z85.encode(hmac.new(secret, label, hashlib.sha256).digest())


@dataclass(frozen=True)
class SocketLimits:
    """Timeouts and budgets of the control plane's sockets (one source of defaults)."""

    #: A connection that has not finished the ZMTP/CURVE handshake by then is closed.
    #: CURVE's four commands take milliseconds; 5 s leaves room for a loaded node.
    handshake_timeout: timedelta = timedelta(seconds=5)
    #: ZMTP PING every this often on an established connection...
    heartbeat_interval: timedelta = timedelta(seconds=2)
    #: ...and the connection is closed (the DEALER reconnects) when nothing came for this long.
    #: Longer than the supervisor's own heartbeat timeout (5 s), so the application's
    #: detectors, not the transport, decide that a rank is lost.
    heartbeat_timeout: timedelta = timedelta(seconds=10)
    #: Connections still in their handshake at once; past this the oldest is shed (the newest,
    #: most likely a rank that just connected, survives a flood).
    max_pending: int = 256
    #: Established (authenticated) connections at once; the ZAP handler refuses more.
    #: A job's ranks need one each (16,384 ranks: 2,048 nodes x 8).
    max_connections: int = 20_000


DEFAULT_LIMITS = SocketLimits()


def apply_limits(sock: zmq.Socket[bytes], limits: SocketLimits = DEFAULT_LIMITS) -> None:
    """Handshake timeout and ZMTP heartbeats on ``sock`` (call before bind/connect)."""
    sock.setsockopt(zmq.HANDSHAKE_IVL, _ms(limits.handshake_timeout))
    sock.setsockopt(zmq.HEARTBEAT_IVL, _ms(limits.heartbeat_interval))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _ms(limits.heartbeat_timeout))
    sock.setsockopt(zmq.HEARTBEAT_TTL, _ms(limits.heartbeat_timeout))


def make_curve_server(sock: zmq.Socket[bytes], keys: CurveKeys) -> None:
    """Make ``sock`` a CURVE server of the job; its ZAP handler decides who is admitted."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode("ascii"))


def make_curve_client(sock: zmq.Socket[bytes], keys: CurveKeys) -> None:
    """Make ``sock`` a CURVE client of the job's server, with the job's client key pair."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)


def raise_fd_limit() -> int:
    """Raise this process's soft limit on open files to the hard limit; returns the new soft limit.

    Each rank's connection is a file descriptor of the supervisor; the
    common soft limit (1,024) is smaller than a large job.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # keep the soft limit we have; the budget below still holds
    return soft


def _ms(value: timedelta) -> int:
    return max(1, round(value.total_seconds() * 1000))
