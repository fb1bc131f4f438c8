"""The real ControlServer in a process of its own, for the attack suite (test_attacks.py).

    python tests/unit/control/attack_server.py SECRET_HEX HANDSHAKE_MS MAX_PENDING

Prints ``{"endpoint": ...}`` on its first line, then serves until killed. It
answers every ``hello`` with an ``ack`` whose extra fields are the server's
counters and the peer id the hello came from (the routing id the ROUTER gave
it), so a test can see what the server saw. A libzmq abort kills this
process, not the test's.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import timedelta

from torchpass_slurm.control.messages import ACK, HELLO
from torchpass_slurm.control.security import SocketLimits
from torchpass_slurm.control.server import ControlServer


def main(secret_hex: str, handshake_ms: str, max_pending: str) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s: %(message)s")
    limits = SocketLimits(
        handshake_timeout=timedelta(milliseconds=int(handshake_ms)), max_pending=int(max_pending)
    )
    server = ControlServer(bytes.fromhex(secret_hex), "127.0.0.1", limits=limits)
    print(json.dumps({"endpoint": server.endpoint}), flush=True)
    while True:
        for peer, msg in server.poll(timedelta(milliseconds=100)):
            if msg.kind == HELLO:
                server.send(
                    peer,
                    ACK,
                    {
                        "seq": msg.seq,
                        "peer": peer.hex(),
                        "rejected": server.refusals.counts,
                        "refused": server.refused_connections.counts,
                        "connections": server.connections,
                    },
                )


if __name__ == "__main__":
    main(*sys.argv[1:4])
