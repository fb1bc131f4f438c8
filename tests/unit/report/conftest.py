"""Event logs written by the real EventLog under a fake clock, and a fixed console."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from torchpass_slurm.rundir.events import EventLog

#: The fake clock's zero: 2025-03-04 05:06:07 UTC (as in the CLI tests).
T0 = 1741064767.0


class JobLog:
    """A job's ``events.jsonl``; :meth:`at` appends an event ``t`` seconds after :data:`T0`."""

    def __init__(self, run_dir: Path, job: str) -> None:
        self.run_dir = run_dir
        self.now = T0
        self.log = EventLog(run_dir / "events.jsonl", job=job, epoch=1, clock=lambda: self.now)

    def at(self, t: float, kind: str, *, epoch: int | None = None, **fields: Any) -> JobLog:
        self.now = T0 + t
        self.log.append(kind, epoch=epoch, **fields)
        return self

    def started(self, active: list[str], spares: list[str]) -> JobLog:
        return self.at(0.0, "started", active=active, spares=spares)

    def detected(self, t: float, kind: str, node: str, role: str = "active", **fields: Any) -> JobLog:
        """A detection as the supervisor writes it (``_record``)."""
        fields.setdefault("exit_code", 137 if kind == "step_exited" else None)
        return self.at(
            t,
            kind,
            node=node,
            role=role,
            detector=fields.pop("detector", kind),
            detail=fields.pop("detail", f"{node} failed"),
            **fields,
        )

    def migration(
        self,
        t: float,
        epoch: int,
        failed: list[str],
        spares: list[str],
        *,
        last_heartbeat: float | None,
        lost: int = 0,
        recomputed: int = 0,
        resolution: str = "live",
        skip: tuple[str, ...] = (),
        reason: str | None = None,
        held_s: float | None = None,
    ) -> JobLog:
        """A live migration starting ``t`` s in: decide 0.5, rebuild 0.75 (two ranks), agree 0.25,
        transfer 1.0 (two receivers), first step 0.5; kinds in ``skip`` are left out.

        With a drain's ``reason``, a planned one as ``_migrate_planned`` writes it.
        """
        beat = None if last_heartbeat is None else T0 + last_heartbeat
        start: dict[str, Any] = dict(failed=failed, spares=spares, last_heartbeat=beat)
        done: dict[str, Any] = dict(resolution=resolution, lost_steps=lost, recomputed_steps=recomputed)
        if held_s is not None:  # the job held its step this long for a spare
            start.update(held_s=held_s)
        if reason is not None:
            start.update(mode="planned", reason=reason)
            done.update(planned=True)
        steps: list[tuple[float, str, dict[str, Any]]] = [
            (0.0, "migration_started", start),
            (0.5, "group_rebuilt", dict(seconds=0.5)),
            (0.75, "group_rebuilt", dict(seconds=0.75)),
            (1.0, "agreement", dict(committed_step=100)),
            (1.5, "transfer_done", dict(donor=0, receiver=4, bytes=1024, seconds=0.5, retries=0)),
            (2.0, "transfer_done", dict(donor=1, receiver=5, bytes=1024, seconds=1.0, retries=1)),
            (2.5, "first_step", dict(step=101)),
            (2.6, "migration_done", done),
        ]
        for offset, kind, fields in steps:
            if kind not in skip:
                self.at(t + offset, kind, epoch=epoch, **fields)
        self.log.epoch = epoch
        return self

    def close(self) -> None:
        self.log.close()


@pytest.fixture(autouse=True)
def fixed_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 100-column, colourless console."""
    monkeypatch.setenv("COLUMNS", "100")
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def job_log(tmp_path: Path) -> Iterator[Any]:
    """``job_log(name, job)`` -> a new :class:`JobLog` in ``tmp_path/name``; all closed at the end."""
    logs: list[JobLog] = []

    def make(name: str = "r1", job: str = "4242") -> JobLog:
        folder = tmp_path / name
        folder.mkdir()
        logs.append(JobLog(folder, job))
        return logs[-1]

    yield make
    for log in logs:
        log.close()


# --- the scenarios the tests share --------------------------------------------


def two_live_migrations(log: JobLog) -> JobLog:
    """n2's heartbeats lost, then n3 down: both moved live to spares; normal ends are not faults."""
    log.started(["n1", "n2", "n3"], ["s1", "s2"])
    log.detected(10.0, "heartbeat_lost", "n2")
    log.migration(10.5, 2, ["n2"], ["s1"], last_heartbeat=7.0)
    log.detected(14.0, "step_exited", "n2", exit_code=137)  # n2's step ends: the same fault
    log.detected(40.0, "node_down", "n3")
    log.migration(40.25, 3, ["n3"], ["s2"], last_heartbeat=38.0, recomputed=3)
    for node in ("n1", "s1", "s2"):
        log.at(60.0, "step_exited", node=node, exit_code=0)
    log.at(61.0, "finished", exit_code=0, message="training done", restarts=0)
    return log


def checkpoint_restart(log: JobLog) -> JobLog:
    """Today's in-allocation path: a spare promoted, everyone restarted from the checkpoint.

    The detection has no role (an older log): n2 is not a spare, so it is active.
    """
    log.started(["n1", "n2"], ["s1"])
    log.at(10.0, "heartbeat_lost", node="n2", silent_s=20.5)
    log.at(10.25, "spare_promoted", epoch=2, node="s1", replaces="n2", ranks=[4, 5, 6, 7])
    log.log.epoch = 2
    log.at(10.5, "restarted", restarts=1, active=["n1", "s1"], spares=[], from_checkpoint=True)
    log.at(11.0, "step_exited", node="n2", exit_code=137)  # echo of the same fault
    log.at(12.0, "worker_up", node="n1", role="active")
    log.at(30.0, "finished", exit_code=0, message="training done", restarts=1)
    return log


#: A health agent's summary, and the reason the job drains the node with (``MigrationMixin._health_warning``).
ECC = "GPU 2: 12 new correctable ECC errors"
PRE_EMPTIVE = f"torchpass: pre-emptive: WARNING: {ECC}"
#: What the supervisor says when it cannot move a drained node's ranks.
NO_MIGRATION = (
    "no live migration possible (no spare, or a rank not on the elastic loop): the node drains "
    "when the job ends"
)


def every_class(log: JobLog) -> JobLog:
    """n2's heartbeats lost (moved live), n3's health warning (moved ahead of failing), an admin
    drain of n1 with no spare left (deferred): one fault of each class, none losing progress."""
    log.started(["n1", "n2", "n3"], ["s1", "s2"])
    log.detected(10.0, "heartbeat_lost", "n2")
    log.migration(10.5, 2, ["n2"], ["s1"], last_heartbeat=7.0, recomputed=1)
    log.at(30.0, "health_warning", node="n3", status="WARNING", summary=ECC)
    log.at(33.0, "drain_seen", node="n3", reason=PRE_EMPTIVE)
    log.migration(33.5, 3, ["n3"], ["s2"], last_heartbeat=None, reason=PRE_EMPTIVE)
    log.at(37.0, "node_released", node="n3", released=True)
    log.at(50.0, "drain_seen", node="n1", reason="firmware update")
    log.at(50.5, "drain_deferred", node="n1", reason="firmware update", detail=NO_MIGRATION)
    for node in ("n1", "s1", "s2"):
        log.at(60.0, "step_exited", node=node, exit_code=0)
    log.at(61.0, "finished", exit_code=0, message="training done", restarts=0)
    return log


def fatal(log: JobLog) -> JobLog:
    """No spare: n1 goes down and the job gives up."""
    log.started(["n1", "n2"], [])
    log.detected(5.0, "node_down", "n1")
    log.at(5.5, "failed", exit_code=1, message="no hot spare left", restarts=0)
    return log
