"""Per-node heartbeats: a node's ranks beat to its local rank 0, which beats for them all.

With ``TORCHPASS_NODE_HEARTBEAT=1`` (tp run sets it from ``heartbeat_per_node_from``
nodes on) and more than one task on the node, the heartbeat thread of each rank
(:class:`~torchpass_slurm.rank.link.Heartbeat`) hands its beat to one of these::

    local 1..k-1  BeatRelay ──PUSH, signed heartbeat──► ipc://DIR/beats-e<EPOCH>.ipc
                                                          │
    local 0       BeatCollector ◄──PULL─────────────────────┘
                  └─► the supervisor, every interval: {rank, step, state,
                      "tasks": [[local_rank, rank, step, state, age_ms, alive], ...]}

Every other message (hello, standby, reports, bye) still goes straight to the
supervisor, and every rank still receives promote, reconfigure and stop itself.
A rank's beat is signed with the job's secret (``messages.encode``, addressed
to local rank 0's sender name), so the collector counts nothing it cannot
authenticate; what fails its check is logged (rate-limited) and dropped. A
rank that stops beating keeps its last entry, with a growing ``age_ms``: the
supervisor sees it fall silent as it would without aggregation. Each beat
carries its rank's process id, and local rank 0 says with every entry
whether that process still lives (``alive``, :func:`process_alive`): the
supervisor tells a rank that died (its node lost at once) from one that is
stuck (judged by its own timeout), and never takes a node whose local rank 0
beats for a silent node.

``DIR`` is private: ``$TMPDIR`` (else ``/tmp``) ``/torchpass-<uid>-<job>-<node>``,
mode 0700, owned by this user; every rank makes it if it is missing and refuses
it otherwise. A node whose folder or socket cannot be set up beats per rank
(:func:`node_beat` returns None; both ends derive the same path, so they fall
back together). Nothing here imports zmq until a socket is made.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from torchpass_slurm.config import ENV_EPOCH, ENV_NODE_HEARTBEAT, ENV_SECRET_FILE
from torchpass_slurm.control.kinds import Kind
from torchpass_slurm.control.messages import Message, Receiver, SequenceCounter, encode
from torchpass_slurm.control.rank_bodies import MAX_STATE_CHARS, MAX_TASKS, Heartbeat, TaskBeat
from torchpass_slurm.control.schema import JSONObject
from torchpass_slurm.errors import ControlPlaneError
from torchpass_slurm.rank.rankinfo import RankInfo

__all__ = ["NodeBeat", "BeatRelay", "BeatCollector", "node_beat", "beat_dir", "process_alive", "RELAY_HWM"]

#: Beats a rank queues for its local rank 0 before new ones are dropped (it beats every
#: interval; only the latest counts).
RELAY_HWM = 4
#: The longest path of a Unix socket (``sun_path`` holds 108 bytes with its NUL).
MAX_IPC_PATH = 107

Log = logging.Logger | logging.LoggerAdapter[logging.Logger]


def process_alive(pid: int) -> bool:
    """False once the process ``pid`` of this node is gone or a zombie; True while it lives, and
    when that cannot be told (no permission to look: no verdict is no death)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[:1]
    except OSError:  # no /proc (not Linux), or it went meanwhile: os.kill said it was there
        return True
    return state not in ([b"Z"], [b"X"])


class NodeBeat(Protocol):
    """What the heartbeat thread does with its beat on a node with per-node heartbeats."""

    def periodic(self, body: JSONObject) -> JSONObject | None:
        """The heartbeat to send to the supervisor for ``body`` (this rank's beat), or None."""
        ...

    def close(self) -> None: ...


def beat_dir(environ: Mapping[str, str], job_id: str, node: str) -> Path:
    """The node-local folder of a job's beats (not created here)."""
    base = environ.get("TMPDIR") or "/tmp"
    return Path(base) / f"torchpass-{os.geteuid()}-{job_id}-{node}"


def private_dir(path: Path) -> Path:
    """``path`` as a folder of this user's only (made 0700 if missing); ControlPlaneError if it
    is anything else (a link, another owner, open to others)."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        raise ControlPlaneError(f"cannot make the node-local beat folder {path}: {exc}") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise ControlPlaneError(
            f"refusing the node-local beat folder {path}: it is {stat.filemode(st.st_mode)}, owned by "
            f"uid {st.st_uid}; expected a folder of uid {os.geteuid()} with mode 0700",
            hint="remove it, or point TMPDIR at a folder of your own",
        )
    return path


def node_beat(
    environ: Mapping[str, str], job_id: str, node: str, info: RankInfo, log: Log
) -> NodeBeat | None:
    """This rank's part in its node's heartbeats, or None when it beats to the supervisor itself
    (per-node heartbeats off, one task on the node, or no private socket could be set up)."""
    local_rank, local_world_size = info.local_rank, info.local_world_size
    if environ.get(ENV_NODE_HEARTBEAT) != "1" or local_world_size <= 1:
        return None
    from torchpass_slurm.control.secret import load_secret

    epoch = environ.get(ENV_EPOCH) or "0"
    try:
        folder = private_dir(beat_dir(environ, job_id, node))
        endpoint = f"ipc://{folder / f'beats-e{epoch}.ipc'}"
        if len(endpoint) - len("ipc://") > MAX_IPC_PATH:
            raise ControlPlaneError(f"the node-local beat socket {endpoint} is too long for a Unix socket")
        secret = load_secret(Path(environ[ENV_SECRET_FILE]))
        if local_rank == 0:
            return BeatCollector(endpoint, secret, node, local_world_size, log)
        return BeatRelay(endpoint, secret, node, local_rank, log)
    except (ControlPlaneError, KeyError, OSError) as exc:
        log.warning("per-node heartbeats unavailable on %s, beating per rank: %s", node, exc)
        return None


class BeatRelay:
    """A rank other than local rank 0: its beats go to local rank 0, never to the supervisor."""

    def __init__(self, endpoint: str, secret: bytes, node: str, local_rank: int, log: Log) -> None:
        import zmq

        self.sender, self.to = f"{node}/{local_rank}", f"{node}/0"
        self._secret, self._log = secret, log
        self._seq = SequenceCounter()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, RELAY_HWM)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)  # nothing queues before local rank 0 is there
        self._sock.connect(endpoint)
        self._dropped = 0

    def periodic(self, body: JSONObject) -> None:
        import zmq

        beat = replace(Heartbeat.from_body(body), pid=os.getpid()).to_body()
        msg = Message(Kind.HEARTBEAT, self.sender, self._seq.next(), time.time(), beat, to=self.to)
        try:
            self._sock.send_multipart(encode(msg, self._secret), flags=zmq.NOBLOCK)
        except zmq.Again:
            self._dropped += 1
            if self._dropped == 10 or self._dropped % 1000 == 0:  # a few at start: rank 0 binds
                self._log.warning("local rank 0 is not taking beats: %d dropped", self._dropped)
        except (zmq.ZMQError, ControlPlaneError) as exc:
            self._log.warning("cannot send a beat to local rank 0: %s", exc)
        return None

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


class BeatCollector:
    """Local rank 0: takes its node's beats and adds them, with their age, to its own heartbeat."""

    def __init__(self, endpoint: str, secret: bytes, node: str, local_world_size: int, log: Log) -> None:
        import zmq

        self.node, self.local_world_size = node, local_world_size
        self._log = log
        self._bound: Path | None = None
        self._receiver = Receiver(secret, {Kind.HEARTBEAT}, recipient=f"{node}/0")
        #: local rank -> (rank, step, state, monotonic time its last beat arrived, its pid or None)
        self.latest: dict[int, tuple[int | None, int | None, str, float, int | None]] = {}
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, RELAY_HWM * local_world_size)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 4096)  # one rank's beat is about 200 bytes
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ControlPlaneError(f"cannot bind the node-local beat socket {endpoint}: {exc}") from None
        self.endpoint = endpoint
        self._bound = Path(endpoint.removeprefix("ipc://"))

    def periodic(self, body: JSONObject) -> JSONObject:
        self.collect()
        now = time.monotonic()
        tasks = tuple(
            TaskBeat(local, rank, step, state, int((now - at) * 1000), pid is None or process_alive(pid))
            for local, (rank, step, state, at, pid) in sorted(self.latest.items())
        )
        return {**body, **replace(Heartbeat.from_body(body), tasks=tasks[:MAX_TASKS]).to_body()}

    def collect(self) -> None:
        """Take every beat waiting (a few per rank at most); never raises."""
        import zmq

        for _ in range(RELAY_HWM * self.local_world_size + 16):
            try:
                frames = self._sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                self._log.warning("cannot receive beats of the node's ranks: %s", exc)
                return
            msg = self._receiver.accept(frames, "a rank of this node")
            if msg is not None:
                self._take(msg)

    def _take(self, msg: Message) -> None:
        node, _, local = msg.sender.rpartition("/")
        beat = Heartbeat.from_body(msg.body)  # checked by decode already
        state = beat.state
        if (
            node != self.node
            or not (local.isascii() and local.isdigit())
            or not 0 < int(local) < self.local_world_size
        ):
            self._log.warning("ignoring a beat from %r: not another rank of %s", msg.sender, self.node)
        elif len(state) > MAX_STATE_CHARS:
            self._log.warning(
                "ignoring a beat from %s: its state is over %d characters", msg.sender, MAX_STATE_CHARS
            )
        else:
            pid = beat.pid if beat.pid is not None and beat.pid > 0 else None  # None: counts as alive
            self.latest[int(local)] = (beat.rank, beat.step, state, time.monotonic(), pid)

    def close(self) -> None:
        """Close the socket, and remove it and the folder (when nothing else is left in it)."""
        self._sock.close(linger=0)
        self._ctx.term()
        bound, self._bound = self._bound, None
        if bound is not None:
            with contextlib.suppress(OSError):
                bound.unlink()
            with contextlib.suppress(OSError):
                bound.parent.rmdir()
