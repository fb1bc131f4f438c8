"""Settings: environment variable names, defaults and timeouts, in one place.

Precedence everywhere: command line > environment > config file > default.
Every wait in the package has a timeout defined here, named and documented.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from torchpass_slurm.errors import ConfigError
from torchpass_slurm.strenum import StrEnum

# --- environment variables that cross process boundaries ---------------------
# (see docs/design/runtime-contract.md)
ENV_RUN_DIR = "TORCHPASS_RUN_DIR"
ENV_SECRET_FILE = "TORCHPASS_SECRET_FILE"
ENV_NODES = "TORCHPASS_NODES"
ENV_SPARES = "TORCHPASS_SPARES"
#: Seconds a job may hold its step for a spare (``SupervisorConfig.spare_wait``; tp-submit --spare-wait).
ENV_SPARE_WAIT = "TORCHPASS_SPARE_WAIT"
#: Set by tp-submit's batch script of a heterogeneous job: the het group of the training
#: nodes (the supervisor runs in group 0). Unset: the job's own nodes are the training nodes.
ENV_TRAINING_HET_GROUP = "TORCHPASS_TRAINING_HET_GROUP"
ENV_NTASKS_PER_NODE = "TORCHPASS_NTASKS_PER_NODE"
ENV_JOB_ID = "TORCHPASS_JOB_ID"
#: Seconds a rank's control link to the supervisor may stay down (after libzmq's own 10 s
#: heartbeat timeout) before the rank takes the supervisor for dead and ends the job
#: (``rank/orphan.py``); 0 turns that off.
ENV_SUPERVISOR_GRACE = "TORCHPASS_SUPERVISOR_GRACE"
#: The job id that cancels the whole job, set by tp run for its steps (a heterogeneous job's
#: leader; the training component's own id would cancel only that component).
ENV_CANCEL_JOB_ID = "TORCHPASS_CANCEL_JOB_ID"
ENV_CONTROL = "TORCHPASS_CONTROL"
ENV_NODE = "TORCHPASS_NODE"
ENV_ROLE = "TORCHPASS_ROLE"


class NodeRole(StrEnum):
    """A node's role in the job: the membership, ``TORCHPASS_ROLE`` (active | spare), status.json."""

    ACTIVE = "active"  # holds logical ranks of the current epoch
    SPARE = "spare"  # a hot spare in standby
    FAILED = "failed"  # lost; its slot went to a spare
    RELEASED = "released"  # drained: handed over, or being given back to Slurm


ENV_EPOCH = "TORCHPASS_EPOCH"
ENV_RANK_BASE = "TORCHPASS_RANK_BASE"
#: host:port of the job's rendezvous store (a TCPStore the supervisor hosts); every
#: epoch's process group meets under the prefix ``epoch<N>`` in it.
ENV_STORE = "TORCHPASS_STORE"
#: "1": the node's ranks beat to its local rank 0, which sends one heartbeat for all of them
#: (torchpass_slurm/rank/nodebeat.py); tp run sets it when the job has at least
#: ``SupervisorConfig.heartbeat_per_node_from`` nodes.
ENV_NODE_HEARTBEAT = "TORCHPASS_NODE_HEARTBEAT"

#: How a lost rank is recovered: "live" (migrate the state to a spare when the
#: training runs the elastic loop, else restart) or "restart" (always restart
#: every rank from the last checkpoint; the baseline).
ENV_RECOVERY = "TORCHPASS_RECOVERY"
RECOVERY_MODES = ("live", "restart")

#: Which transport carries a live migration's state from a donor to its receiver
#: (``rank/routes.py``, docs/design/transfer.md): ``auto`` (today's: a replica donor over the
#: epoch's torch.distributed group, a rank leaving by a drain over a TCP socket), ``torch``
#: (the same), ``socket`` (every donor over a sealed TCP socket) or ``mpi`` (every replica
#: donor over MPICH connect/accept, run by an MPI helper process of each end, launched on its
#: own node: the steps need no Slurm MPI plugin). A failed socket or MPI route falls back to
#: the group.
#: Precedence: tp-submit --transport > this variable > the site file's ``[transfer] transport``
#: > ``auto``; tp-submit exports the result, so the supervisor and every rank read the same.
ENV_TRANSPORT = "TORCHPASS_TRANSPORT"
TRANSPORTS = ("auto", "socket", "torch", "mpi")
DEFAULT_TRANSPORT = "auto"


def check_transport(value: str, origin: str) -> str:
    """``value`` (from ``origin``: an option, a variable, a file) as a transport name; a
    ConfigError that lists the valid ones otherwise."""
    name = value.strip().lower()
    if name not in TRANSPORTS:
        raise ConfigError(
            f"{origin}: unknown transport {value!r}",
            hint=f"the valid transports are {', '.join(TRANSPORTS)} (auto: a replica over the "
            "training's torch group, a leaving rank over a socket)",
        )
    return name


def transport_from_env(environ: Mapping[str, str] | None = None) -> str:
    """The job's transport: ``TORCHPASS_TRANSPORT`` (checked), else ``auto``."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_TRANSPORT)
    if raw is None or raw.strip() == "":
        return DEFAULT_TRANSPORT
    return check_transport(raw, f"{ENV_TRANSPORT}={raw!r}")


#: Timeout of one Slurm command: TORCHPASS_SLURM_TIMEOUT, read by slurm/runner.py.

#: Timeout of one collective in the elastic loop, seconds. A dead peer usually
#: fails a collective at once (connection reset); one that vanished silently
#: blocks its peers this long, so it bounds detection by the ranks themselves.
ENV_COLLECTIVE_TIMEOUT = "TORCHPASS_COLLECTIVE_TIMEOUT"
#: Seconds between two health checks of the in-job agent (0: no agent); see
#: torchpass_slurm/rank/health_agent.py.
ENV_HEALTH_INTERVAL = "TORCHPASS_HEALTH_INTERVAL"
DEFAULT_HEALTH_INTERVAL_S = 60.0
DEFAULT_SUPERVISOR_GRACE_S = 15.0
DEFAULT_COLLECTIVE_TIMEOUT_S = 15.0

#: The environment a rank that trains on NCCL needs for in-process recovery (name -> (value,
#: why)); ``tp run`` puts each in every step's environment unless the job set it itself
#: (:func:`nccl_recovery_env`), and a rank that builds a NCCL group warns about a value that
#: defeats it (``rank/backends.py``). Harmless without NCCL: only torch's ProcessGroupNCCL
#: and libnccl read them, when a NCCL communicator is made. docs/design/nccl.md.
NCCL_RECOVERY_ENV: Mapping[str, tuple[str, str]] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": (
        "2",
        "on a failed or timed-out collective the watchdog aborts the communicator only; "
        "torch's default (3) ends the process, and a survivor must live to rejoin",
    ),
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": (
        "0",
        "a CUDA error the watchdog sees is not rethrown on its thread (which ends the process)",
    ),
    "TORCH_NCCL_ENABLE_MONITORING": (
        "0",
        "no heartbeat monitor that kills a rank whose watchdog is stuck (480 s): the supervisor's "
        "heartbeats and hang watch judge a stuck rank, and a survivor in an abort is not stuck",
    ),
    "TORCH_NCCL_USE_COMM_NONBLOCKING": (
        "1",
        "every communicator non-blocking, a DeviceMesh's sub-groups too: only a non-blocking "
        "communicator can be aborted at any point (NCCL's fault-tolerance rule)",
    ),
    "TORCH_NCCL_NONBLOCKING_TIMEOUT": (
        "120",
        "a non-blocking init or finalize waits this long (seconds; torch's default is 30 min), "
        "the rendezvous timeout of an epoch (rank/elastic.py RENDEZVOUS_TIMEOUT)",
    ),
    "NCCL_NVLS_ENABLE": (
        "0",
        "no NVLink SHARP buffers: their multicast memory is not released by an abort "
        "(NVIDIA resiliency-ext's known issue for in-process restart)",
    ),
}


def nccl_recovery_env(job_env: Mapping[str, str]) -> dict[str, str]:
    """The variables of :data:`NCCL_RECOVERY_ENV` that ``job_env`` (the job's own environment)
    does not set, with their values: the job's own setting wins (precedence: environment >
    default), and a rank warns when it defeats recovery."""
    return {name: value for name, (value, _) in NCCL_RECOVERY_ENV.items() if name not in job_env}


def env_float(name: str, default: float, *, minimum: float = 0.0) -> float:
    """A float setting from the environment, with a clear error on bad values."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(
            f"{name}={raw!r} is not a number", hint=f"unset it or give seconds, e.g. {default:g}"
        ) from None
    if value < minimum:
        raise ConfigError(f"{name}={raw!r} is below the minimum {minimum:g}")
    return value


def env_int(name: str, default: int | None = None, *, minimum: int = 0) -> int:
    """An integer setting from the environment; ``default`` None makes it required."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ConfigError(
                f"the environment variable {name} is not set",
                hint="run this under tp-submit / tp run, which set it",
            )
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ConfigError(f"{name}={raw!r} is below the minimum {minimum}")
    return value


#: Settings for which 0 means "never" (every other one must be above 0).
MAY_BE_ZERO = frozenset({"spare_wait"})


@dataclass(frozen=True)
class SupervisorConfig:
    """Timing of the supervisor (tp run). All values in seconds, but ``hang_factor``, the port
    and ``heartbeat_per_node_from`` (nodes)."""

    #: Interval between worker heartbeats (4 Hz: a silent node is noticed within a second).
    heartbeat_interval: float = 0.25
    #: A step silent for this long is suspected; its loss is declared at once when a second
    #: signal confirms it (a peer's failed collective named its address, or its slurmd does
    #: not accept a TCP connection): see supervisor/detect.py.
    silence_threshold: float = 1.0
    #: Silence that nothing confirms (the node still answers: a frozen or hung process) is
    #: declared a loss after this long.
    heartbeat_timeout: float = 5.0
    #: With per-node heartbeats, a rank silent while its node beats and its process lives is
    #: hung after ``heartbeat_timeout``; after this long instead when its last word was that
    #: its collective failed (it is tearing its group down: torch's teardown may hold the GIL,
    #: and its heartbeat thread with it). Only that rank is blamed, never its node's silence.
    teardown_timeout: float = 20.0
    #: A job whose highest step has not moved for max(``hang_floor``, ``hang_factor`` x its
    #: median step time) while every rank computes or synchronises a step is hung: the ranks
    #: behind are blamed (the silent ones, else those still computing a step their peers wait
    #: in). Time while a rank is in ``on_commit`` (checkpoints) or recovering never counts.
    hang_factor: float = 3.0
    hang_floor: float = 2.0
    #: Ambiguous evidence (a step exit when the ranks do not all run the elastic loop, a
    #: failed collective that names nobody silent) is weighed this long at most; confirmed
    #: evidence ends the window early. At its end the steps silent all along are blamed,
    #: else the first step that exited.
    fault_settle: float = 3.0
    #: The TCP port of slurmd on the compute nodes (Slurm's SlurmdPort), probed to confirm
    #: that a silent node is gone, and how long one probe waits for the connection.
    probe_port: int = 6818
    probe_timeout: float = 0.5
    #: Interval between polls of Slurm for the job's node states (never a tight loop).
    slurm_poll_interval: float = 5.0
    #: How long a started step may take to say hello before it counts as failed.
    startup_timeout: float = 300.0
    #: How long stopping a healthy step may take before its srun is killed.
    stop_timeout: float = 15.0
    #: A live, planned or regroup recovery that has not reached its first step this long
    #: after it started goes back to the planner, which restarts every rank from the
    #: checkpoint (a recovery waiting on a rank that will never come must not hang the job).
    recovery_timeout: float = 60.0
    #: How far ahead, in seconds of training, a planned switch (a drain) is announced: the
    #: ranks switch after step "highest step now + this many seconds of steps + 1", which
    #: every rank hears of before it gets there (the control plane takes milliseconds).
    switch_lead: float = 1.0
    #: A lost step's srun gets SIGTERM and, this long after, SIGKILL; the recovery does not
    #: wait for either (a dead node cannot answer). Slurm ends the step anyway once it
    #: declares the node down.
    lost_stop_timeout: float = 0.5
    #: From this many nodes (active + spares) on, the heartbeats are per node: local rank 0 of
    #: each node sends one heartbeat that carries its node's other tasks (``tasks``), which beat
    #: to it over a node-local socket (``TORCHPASS_NODE_HEARTBEAT``; docs/protocol.md). One
    #: supervisor cannot take 4 Hz beats of every rank at thousands of ranks
    #: (docs/design/control-plane-scale.md).
    heartbeat_per_node_from: int = 256
    #: When a spare was used, Slurm is asked for a node to refill the pool (job expansion,
    #: supervisor/refill.py): how long one request waits for a node, and how long after a
    #: refusal the next request is made.
    refill_wait: float = 60.0
    refill_retry: float = 30.0
    #: With no spare left for a lost rank whose state a replica holds, and a pool that can
    #: refill, the survivors hold the committed step in memory up to this long for a node
    #: (supervisor/hold.py); the move is then live. After it, the job restarts in place where
    #: it can, else ends. 0: never hold.
    spare_wait: float = 300.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SupervisorConfig:
        """The defaults, each overridden by ``TORCHPASS_<SETTING>`` when set (e.g.
        ``TORCHPASS_HEARTBEAT_INTERVAL=0.5``); sbatch exports them to every step, so the
        ranks and the supervisor agree. A bad value is a ConfigError naming the variable."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            name = f"TORCHPASS_{f.name.upper()}"
            raw = env.get(name)
            if raw is None or raw == "":
                continue
            kind = _setting_type(f.default)
            try:
                value = kind(raw)
            except ValueError:
                noun = "an integer" if kind is int else "a number of seconds"
                raise ConfigError(f"{name}={raw!r} is not {noun}") from None
            if value < 0 or (value == 0 and f.name not in MAY_BE_ZERO):
                floor = "0 or more" if f.name in MAY_BE_ZERO else "above 0"
                raise ConfigError(f"{name}={raw!r} must be {floor}")
            values[f.name] = value
        return cls(**values)

    @classmethod
    def from_mapping(cls, values: dict[str, float]) -> SupervisorConfig:
        """Build from a mapping; unknown keys are errors that list the valid ones."""
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - valid)
        if unknown:
            raise ConfigError(
                f"unknown supervisor setting(s): {', '.join(unknown)}",
                hint=f"valid settings: {', '.join(sorted(valid))}",
            )
        types = {f.name: _setting_type(f.default) for f in fields(cls)}
        typed: dict[str, Any] = {k: types[k](v) for k, v in values.items()}
        return cls(**typed)


def _setting_type(default: object) -> type[int] | type[float]:
    """A setting is an int (a port, a node count) when its default is one, else seconds as a float."""
    return int if isinstance(default, int) else float
