"""The authenticated control plane between the supervisor and the ranks.

* :mod:`~torchpass_slurm.control.kinds`: the message and report kinds;
* :mod:`~torchpass_slurm.control.messages`: HMAC framing, the body of each kind, replay guard (no zmq);
* :mod:`~torchpass_slurm.control.schema`: a body's wire rules, derived from its dataclass;
* :mod:`~torchpass_slurm.control.bodies`: the typed bodies the supervisor sends;
* :mod:`~torchpass_slurm.control.rank_bodies`: the typed bodies a rank sends;
* :mod:`~torchpass_slurm.control.reports`: a rank's reports, one class of fields per kind;
* :mod:`~torchpass_slurm.control.secret`: the per-job secret file;
* :mod:`~torchpass_slurm.control.server`: the supervisor's ROUTER socket;
* :mod:`~torchpass_slurm.control.client`: a rank's DEALER socket.

Import the module you need: this package imports nothing, so that the rank
side can use the message vocabulary without loading zmq. The protocol is
specified in ``docs/protocol.md``.
"""
