"""Typed, immutable views of what Slurm reports: :class:`Node`, :class:`Job`, :class:`SlurmVersion`.

They are built by the pure parsers in :mod:`torchpass_slurm.slurm.parse` and
never talk to Slurm themselves. States are upper-case Slurm words: a node's
``state`` is its base state (``IDLE``, ``MIXED``, ``ALLOCATED``, ``DOWN``, ...)
and ``flags`` the rest (``DRAIN``, ``NOT_RESPONDING``, ``COMPLETING``, ...),
exactly as ``scontrol show node`` writes ``State=MIXED+DRAIN``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Node", "Job", "SlurmVersion", "NODE_BASE_STATES", "JOB_FINISHED_STATES"]

#: Base node states, as Slurm names them (anything else in a state is a flag).
NODE_BASE_STATES = frozenset({"IDLE", "ALLOCATED", "MIXED", "DOWN", "ERROR", "FUTURE", "UNKNOWN"})

#: Job states after which the job holds no nodes.
JOB_FINISHED_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)


@dataclass(frozen=True)
class Node:
    """One node as Slurm sees it now."""

    name: str
    state: str
    flags: frozenset[str] = frozenset()
    reason: str | None = None
    partitions: tuple[str, ...] = ()
    cpus: int | None = None
    #: when slurmd last started on the node (epoch seconds); only ``scontrol show node`` says
    slurmd_started: float | None = None

    @property
    def state_text(self) -> str:
        """``MIXED+DRAIN`` style, flags sorted: how ``scontrol`` would print it."""
        return "+".join([self.state, *sorted(self.flags)])

    @property
    def is_drain(self) -> bool:
        """An admin (or a health check) asked that no new work lands here."""
        return "DRAIN" in self.flags

    @property
    def is_draining(self) -> bool:
        """Drain requested while jobs still run on it (``MIXED+DRAIN``, ``ALLOCATED+DRAIN``)."""
        return self.is_drain and self.state in {"ALLOCATED", "MIXED"}

    @property
    def is_drained(self) -> bool:
        """Drain requested and no job left on it: maintenance may start."""
        return self.is_drain and not self.is_draining

    @property
    def is_down(self) -> bool:
        return self.state == "DOWN"

    @property
    def is_responding(self) -> bool:
        """False once slurmctld has lost contact with the node's slurmd."""
        return "NOT_RESPONDING" not in self.flags

    @property
    def is_usable(self) -> bool:
        """Up, responding, not drained or failing: fit to run (or keep running) work."""
        bad = {"DRAIN", "NOT_RESPONDING", "FAIL", "MAINTENANCE", "REBOOT_REQUESTED"}
        return self.state in {"IDLE", "MIXED", "ALLOCATED"} and not (self.flags & bad)


@dataclass(frozen=True)
class Job:
    """One job as Slurm sees it now.

    ``nodes`` is the CURRENT node list, expanded, as read from Slurm. It shrinks
    when the job loses or sheds a node; ``SLURM_JOB_NODELIST`` in the job's
    environment does not, so never use that variable for membership.
    """

    job_id: int
    name: str
    state: str
    nodes: tuple[str, ...] = ()
    flags: frozenset[str] = frozenset()
    batch_host: str | None = None
    partition: str | None = None
    reason: str | None = None
    num_nodes: int | None = None
    #: The job's ``--comment`` (tp-submit writes ``torchpass:run_dir=PATH`` there).
    comment: str | None = None
    #: Path of the batch script's stdout, as Slurm expanded it (``%j`` filled in).
    std_out: str | None = None
    work_dir: str | None = None

    @property
    def is_pending(self) -> bool:
        return self.state == "PENDING"

    @property
    def is_running(self) -> bool:
        return self.state == "RUNNING"

    @property
    def is_finished(self) -> bool:
        return self.state in JOB_FINISHED_STATES


@dataclass(frozen=True, order=True)
class SlurmVersion:
    """A Slurm release, e.g. ``24.11.5``; ``major_minor`` is what APIs are tied to."""

    major: int
    minor: int
    micro: int = 0
    extra: str = field(default="", compare=False)

    @property
    def major_minor(self) -> str:
        return f"{self.major:02d}.{self.minor:02d}"

    def __str__(self) -> str:
        return f"{self.major:02d}.{self.minor:02d}.{self.micro}{self.extra}"
