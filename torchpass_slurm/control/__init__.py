"""The authenticated control plane between the supervisor and the ranks.

* :mod:`~torchpass_slurm.control.messages`: kinds, HMAC framing, replay guard (no zmq);
* :mod:`~torchpass_slurm.control.bodies`: the typed bodies and reports (no zmq);
* :mod:`~torchpass_slurm.control.secret`: the per-job secret file;
* :mod:`~torchpass_slurm.control.server`: the supervisor's ROUTER socket;
* :mod:`~torchpass_slurm.control.client`: a rank's DEALER socket.

Import the module you need: this package imports nothing, so that the rank
side can use the message vocabulary without loading zmq. The protocol is
specified in ``docs/protocol.md``.
"""
