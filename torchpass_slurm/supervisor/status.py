"""The job's status snapshot: what `tp status` shows, written by the supervisor.

The supervisor rewrites ``RUN_DIR/status.json`` atomically (temporary file,
then rename) about once a second; readers never see a half-written file. The
event log (:mod:`torchpass_slurm.events`) is the history; this file is only
the present.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchpass_slurm.config import NodeRole
from torchpass_slurm.errors import StatusError

if TYPE_CHECKING:
    from torchpass_slurm.supervisor.state import JobState

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

    def to_json(self) -> str:
        data = asdict(self)
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


def job_status(job: JobState, run_dir: Path, now: float) -> JobStatus:
    """The snapshot of ``job`` at unix time ``now``."""
    m = job.membership
    nodes = []
    for node, step in job.steps.items():
        role = m.role_of(node) if node in m.active + m.spares + m.failed else step.role
        if node in job.released or node in job.releasing:
            role = NodeRole.RELEASED
        nodes.append(
            NodeStatus(
                node=node,
                role=role,
                ranks=tuple(m.ranks_of(node)) if role == NodeRole.ACTIVE else (),
                state=step.state.value,
                last_step=step.last_step,
                last_heartbeat=step.last_heartbeat,
                exit_code=step.exit_code,
            )
        )
    return JobStatus(
        job_id=str(job.job_id),
        run_dir=str(run_dir),
        state=job.state.value,
        epoch=m.epoch,
        world_size=m.world_size,
        updated=now,
        nodes=tuple(nodes),
        restarts=job.restarts,
        message=job.message,
        holding=tuple(job.holding.nodes) if job.holding else (),
        holding_until=job.holding.since + job.holding.wait_s if job.holding else None,
    )


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
