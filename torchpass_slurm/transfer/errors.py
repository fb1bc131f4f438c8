"""Errors of the state transfer layer.

::

    TorchpassError
    └── TransferError          exit 6   a state transfer failed (peer gone, corrupt data, bad manifest)
        └── TransferTimeout             one transport call did not finish within its timeout

A transport that raised is broken: every later call raises ``TransferError``
again. Build a new transport (a new connection, or the next epoch's process
group) and retry; :class:`~torchpass_slurm.transfer.stream.ReceiveProgress`
lets the retry resume where the failed one stopped.
"""

from __future__ import annotations

from torchpass_slurm.errors import TorchpassError

__all__ = ["TransferError", "TransferTimeout"]


class TransferError(TorchpassError):
    """Moving a training state between two ranks failed."""

    exit_code = 6


class TransferTimeout(TransferError):
    """A transport call did not complete within its ``timeout``."""
