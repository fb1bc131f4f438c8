"""The job's status file, ``RUN_DIR/status.json``: the present, as `tp status` shows it.

The supervisor rewrites it atomically (temporary file, fsync, then rename) about
once a second (:func:`torchpass_slurm.supervisor.status.job_status` builds the
snapshot); readers never see a half-written file. Its ``updated`` time is also the
supervisor's lease that the ranks watch (``rank/orphan.py``). The event log
(:mod:`torchpass_slurm.rundir.events`) is the history; this file is only the present.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from torchpass_slurm.errors import StatusError

__all__ = ["STATUS_FILE", "FORMAT", "NodeStatus", "JobStatus", "write_status", "read_status"]

STATUS_FILE = "status.json"
FORMAT = 1


@dataclass(frozen=True)
class NodeStatus:
    """One node of the job as the supervisor sees it."""

    node: str
    #: active | spare | failed | released
    role: str
    #: global ranks the node holds (empty for spares)
    ranks: tuple[int, ...] = ()
    #: starting | running | standby | stopping | exited | lost
    state: str = "starting"
    last_step: int | None = None
    #: unix time of the last heartbeat (None: none yet)
    last_heartbeat: float | None = None
    exit_code: int | None = None


@dataclass(frozen=True)
class JobStatus:
    """The whole job: supervisor state, membership epoch and every node."""

    job_id: str
    run_dir: str
    state: str
    epoch: int
    world_size: int
    updated: float
    nodes: tuple[NodeStatus, ...] = field(default_factory=tuple)
    restarts: int = 0
    message: str = ""
    #: the lost nodes the job holds its committed step for, waiting for a spare
    #: (``supervisor/hold.py``), and when that wait ends (unix time)
    holding: tuple[str, ...] = ()
    holding_until: float | None = None
    #: what carries a live migration's state (config.ENV_TRANSPORT: auto, socket, torch, mpi)
    transport: str = "auto"

    def to_json(self) -> str:
        # what dataclasses.asdict gives, built flat: its deep copy of every node took 60 ms of
        # the supervisor's loop once a second at 2,048 nodes
        data: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        per_node = fields(NodeStatus)
        data["nodes"] = [{f.name: getattr(n, f.name) for f in per_node} for n in self.nodes]
        data["format"] = FORMAT
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> JobStatus:
        try:
            data: dict[str, Any] = json.loads(text)
            data.pop("format", None)
            nodes = tuple(
                NodeStatus(**{**n, "ranks": tuple(n.get("ranks", ()))}) for n in data.pop("nodes", ())
            )
            holding = tuple(data.pop("holding", ()))
            return cls(**data, nodes=nodes, holding=holding)
        except (ValueError, TypeError) as err:
            raise StatusError(f"malformed status file: {err}") from None


def write_status(run_dir: Path, status: JobStatus) -> None:
    """Replace ``run_dir/status.json`` atomically and durably (fsync, then rename)."""
    run_dir = Path(run_dir)
    fd, tmp = tempfile.mkstemp(prefix=".status-", suffix=".json", dir=run_dir)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(status.to_json())
            f.flush()
            os.fsync(f.fileno())  # the rename must not land before the bytes (a crash leaves it empty)
        os.replace(tmp, run_dir / STATUS_FILE)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_status(run_dir: Path) -> JobStatus:
    """Read ``run_dir/status.json``; :class:`StatusError` if absent or malformed."""
    path = Path(run_dir) / STATUS_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise StatusError(
            f"no status file at {path}",
            hint="the job may not have started yet, or this is not a tp run folder",
        ) from None
    return JobStatus.from_json(text)
