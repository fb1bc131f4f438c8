"""The status snapshot (``supervisor/status.py``, ``rundir/status.py``): each node's role and
ranks as the membership says them, and the file's JSON as ``dataclasses.asdict`` gives it
(both are built in one pass now: a scan per node took a quarter of a second at 2,048 nodes)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from torchpass_slurm.config import NodeRole
from torchpass_slurm.rundir.status import FORMAT, JobStatus
from torchpass_slurm.supervisor.membership import Membership
from torchpass_slurm.supervisor.state import JobState
from torchpass_slurm.supervisor.status import job_status
from torchpass_slurm.supervisor.workers import WorkerStep

from .fakes import FakeProcess, VirtualClock


def test_roles_and_ranks_are_the_memberships(tmp_path: Path) -> None:
    m = Membership.initial(["a", "b", "c", "s1", "s2"], 3, 4).replace("b")  # s1 takes b's slot
    job = JobState(job_id=7, membership=m)
    for node in ("a", "b", "c", "s1", "s2", "x"):
        step = WorkerStep(node, NodeRole.SPARE, 0, 4, FakeProcess(VirtualClock()), 0.0)  # type: ignore[arg-type]
        job.launched(node, step)
    job.releasing.add("c")

    status = job_status(job, tmp_path, 1000.0)

    got = {n.node: (n.role, n.ranks) for n in status.nodes}
    assert got == {
        "a": (NodeRole.ACTIVE, (0, 1, 2, 3)),
        "b": (NodeRole.FAILED, ()),
        "c": (NodeRole.RELEASED, ()),
        "s1": (NodeRole.ACTIVE, (4, 5, 6, 7)),
        "s2": (NodeRole.SPARE, ()),
        "x": (NodeRole.SPARE, ()),  # not in the membership: the step's own role
    }
    for node in ("a", "s1"):
        assert got[node][1] == tuple(m.ranks_of(node))


def test_the_file_is_what_asdict_gives(tmp_path: Path) -> None:
    m = Membership.initial(["a", "b", "s"], 2, 2)
    job = JobState(job_id=7, membership=m)
    for node in ("a", "b", "s"):
        job.launched(node, WorkerStep(node, m.role_of(node), 0, 2, FakeProcess(VirtualClock()), 0.0))  # type: ignore[arg-type]
    job.steps["a"].seen("a/0", 5.0, 3, "sync")
    status = dataclasses.replace(job_status(job, tmp_path, 1000.0), holding=("b",), holding_until=9.5)

    expected = {**dataclasses.asdict(status), "format": FORMAT}
    assert status.to_json() == json.dumps(expected, indent=2, sort_keys=True)
    assert JobStatus.from_json(status.to_json()) == status
