"""The authenticated control plane between the supervisor and the ranks.

* :mod:`~torchpass_slurm.control.messages`: kinds, bodies, HMAC framing, replay guard;
* :mod:`~torchpass_slurm.control.secret`: the per-job secret file;
* :mod:`~torchpass_slurm.control.server`: the supervisor's ROUTER socket;
* :mod:`~torchpass_slurm.control.client`: a rank's DEALER socket.

The protocol is specified in ``docs/protocol.md``.
"""

from torchpass_slurm.control.client import ControlClient
from torchpass_slurm.control.messages import (
    ACK,
    BYE,
    HEARTBEAT,
    HELLO,
    PROMOTE,
    STANDBY,
    STOP,
    Message,
    ReplayGuard,
    decode,
    encode,
)
from torchpass_slurm.control.secret import create_secret, load_secret
from torchpass_slurm.control.server import ControlServer

__all__ = [
    "ACK",
    "BYE",
    "HEARTBEAT",
    "HELLO",
    "PROMOTE",
    "STANDBY",
    "STOP",
    "ControlClient",
    "ControlServer",
    "Message",
    "ReplayGuard",
    "create_secret",
    "decode",
    "encode",
    "load_secret",
]
