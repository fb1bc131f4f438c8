"""The vocabulary of the control plane: message kinds and report kinds (no zmq, no I/O).

:mod:`~torchpass_slurm.control.messages` frames and checks messages of these
kinds; :mod:`~torchpass_slurm.control.bodies` types their bodies. The
supervisor, the rank side and the test fakes all use these enums.
"""

from __future__ import annotations

from torchpass_slurm.strenum import StrEnum

__all__ = ["Kind", "ReportKind"]


class Kind(StrEnum):
    """The kind of a control message (frame 1's ``kind``)."""

    # worker -> supervisor
    HELLO = "hello"
    HEARTBEAT = "heartbeat"
    STANDBY = "standby"
    BYE = "bye"
    #: a rank reports a fact for the event log or a failed collective (body: event, fields)
    REPORT = "report"
    #: a copy of the state that belongs to this rank, valid once step ``step`` commits
    #: (body: rank, step, state; ``control/rankstate.py``)
    RANK_STATE = "rank_state"
    # supervisor -> worker
    PROMOTE = "promote"
    STOP = "stop"
    #: survivors of a fault: rebuild the process group for a new epoch (live migration)
    RECONFIGURE = "reconfigure"
    # both ways: acknowledges the message with sequence number body["seq"]
    ACK = "ack"


class ReportKind(StrEnum):
    """The ``event`` of a REPORT: what a rank tells the supervisor (see docs/protocol.md)."""

    #: its training runs the elastic loop (it can rebuild its group in place)
    LIVE_READY = "live_ready"
    #: a collective failed (a peer died, or the network broke); it waits for a reconfigure
    COLLECTIVE_FAILED = "collective_failed"
    #: the new epoch's process group is up (seconds=)
    GROUP_REBUILT = "group_rebuilt"
    #: rank 0: the committed step every rank now holds (committed_step=, donors=, receivers=)
    AGREEMENT = "agreement"
    #: a receiver: the state arrived (donor=, bytes=, seconds=, retries=)
    TRANSFER_DONE = "transfer_done"
    #: rank 0: the first step of the new epoch committed (step=)
    FIRST_STEP = "first_step"
    #: a rank of a drained node handed over and left the job
    RELEASED = "released"
    #: rank 0 resumed from a checkpoint after a restart (step=)
    RESUMED = "resumed"
    #: the node's in-job health agent saw WARNING or CRITICAL (status=, summary=)
    HEALTH_WARNING = "health_warning"
    #: a rank that took over found no copy of its rank state tagged with the agreed step
    #: (step=, tags=); it stops rather than load a wrong one
    RANK_STATE_MISSING = "rank_state_missing"
