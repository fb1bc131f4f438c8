"""Live state transfer: move a rank's in-memory training state to a hot spare.

Two layers:

- :mod:`.transport`: :class:`Transport`, a point-to-point byte pipe to one peer
  where every call takes an explicit ``timedelta`` timeout, with these
  implementations: :class:`TorchTransport` (torch.distributed send/recv on a
  process group: gloo on CPU, NCCL on GPU), :class:`SocketTransport` (plain
  TCP), :class:`MPITransport` (mpi4py on an intercommunicator, in the calling
  process) and ``mpi_process.MPIProcessTransport`` (the same MPI in a helper
  process the rank can kill: what ``TORCHPASS_TRANSPORT=mpi`` uses).
- :mod:`.stream`: :func:`send_state` / :func:`recv_state` move a nested
  ``state_dict`` (tensors, JSON scalars, dicts with str or int keys, lists,
  tuples) without pickle: a JSON manifest, then the tensors' bytes as checksummed
  chunks, pipelined, resumable from another donor, with bad chunks resent.

Failures raise :class:`~torchpass_slurm.errors.TransferError` (a call past its
timeout: ``TransferTimeout``). A transport that raised is broken: every later
call raises again. Build a new one and retry; :class:`ReceiveProgress` lets the
retry resume where the failed one stopped. The wire format and the measured
throughputs are in ``docs/design/transfer.md``.

Importing this package does not import torch or mpi4py; the names below are
loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "Transport",
    "Handle",
    "TorchTransport",
    "SocketTransport",
    "SocketListener",
    "MPITransport",
    "Manifest",
    "ReceiveProgress",
    "TransferStats",
    "send_state",
    "recv_state",
]

_LAZY = {
    "Transport": "transport",
    "Handle": "transport",
    "TorchTransport": "torch_transport",
    "SocketTransport": "socket_transport",
    "SocketListener": "socket_transport",
    "MPITransport": "mpi_transport",
    "Manifest": "manifest",
    "ReceiveProgress": "stream",
    "TransferStats": "stream",
    "send_state": "stream",
    "recv_state": "stream",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
