"""Assemble a :class:`~torchpass_slurm.supervisor.loop.Supervisor` for ``tp run``.

Kept apart from :mod:`torchpass_slurm.cli.run`, so that ``tp run --help`` imports nothing heavy.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path

from torchpass_slurm import config as cfg
from torchpass_slurm.control.secret import create_secret, load_secret
from torchpass_slurm.control.server import ControlServer, job_address
from torchpass_slurm.errors import ConfigError
from torchpass_slurm.rundir.events import EVENTS_FILE, EventLog
from torchpass_slurm.slurm import select_backend
from torchpass_slurm.supervisor.loop import Supervisor
from torchpass_slurm.supervisor.membership import Membership
from torchpass_slurm.supervisor.probe import NodeProbe
from torchpass_slurm.supervisor.store_host import StoreHost
from torchpass_slurm.supervisor.workers import StepLauncher

logger = logging.getLogger(__name__)


def build_supervisor(
    *,
    job_id: int,
    command: Sequence[str],
    spares: int,
    ntasks_per_node: int,
    run_dir: Path,
    host: str,
    recovery: str = "live",
) -> Supervisor:
    slurm = select_backend()
    training_job_id, step_args = training_component(job_id, os.environ)
    job = slurm.job(training_job_id)
    if step_args:  # the supervisor off the training nodes: their first node is a spare
        nodes = _component_head_last(job.nodes, job.batch_host)
    else:
        nodes = _ordered_nodes(job.nodes, job.batch_host)
    n_active = cfg.env_int(cfg.ENV_NODES, len(nodes) - spares, minimum=1)
    if n_active + spares > len(nodes):
        raise ConfigError(
            f"job {job_id} has {len(nodes)} node(s) ({', '.join(nodes)}) but {n_active} active "
            f"+ {spares} spare(s) were asked for",
            hint="submit with tp-submit, which asks Slurm for N+S nodes",
        )
    membership = Membership.initial(nodes[: n_active + spares], n_active, ntasks_per_node)
    run_dir.mkdir(parents=True, exist_ok=True)
    secret_file = Path(os.environ.get(cfg.ENV_SECRET_FILE) or create_secret(run_dir))
    secret = load_secret(secret_file)
    # the job's own interface only; the ranks are given this address
    address = job_address(host)
    server = ControlServer(secret, bind_host=address, port=0)
    # the id that cancels the whole job (a heterogeneous job's leader), for ranks whose
    # supervisor is gone (rank/orphan.py): the training component's own id cancels only it
    env = {
        cfg.ENV_SECRET_FILE: str(secret_file),
        cfg.ENV_RUN_DIR: str(run_dir),
        cfg.ENV_CANCEL_JOB_ID: str(job_id),
    }
    # the job's rendezvous store: beside the supervisor (it outlives every worker node), in a
    # process of its own, bound to the job's address, for holders of the secret only
    store = StoreHost.start(address, secret_file, STORE_MAX_WAIT)
    env[cfg.ENV_STORE] = f"{address}:{store.port}"
    config = cfg.SupervisorConfig.from_env()
    launcher = StepLauncher(
        slurm,
        job_id=training_job_id,
        command=command,
        control_endpoint=server.endpoint,
        base_env=env,
        heartbeat_per_node_from=config.heartbeat_per_node_from,
        step_args=step_args,
    )
    events = EventLog(run_dir / EVENTS_FILE, job=str(job_id), epoch=membership.epoch)
    logger.info(
        "supervising job %d%s: active %s, spares %s, control %s",
        job_id,
        f" (training nodes: component {training_job_id}, the supervisor on {host})" if step_args else "",
        ",".join(membership.active),
        ",".join(membership.spares) or "-",
        server.endpoint,
    )
    probe = NodeProbe(
        membership.active + membership.spares, port=config.probe_port, timeout=config.probe_timeout
    )
    supervisor = Supervisor(
        job_id=training_job_id,
        run_dir=run_dir,
        membership=membership,
        launcher=launcher,
        server=server,
        slurm=slurm,
        events=events,
        config=config,
        probe=probe,
        store=(address, store.port),
        recovery=recovery,
        batch_host=host,
        refill=True,
    )
    supervisor.keepalive = store  # the store lives as long as the supervisor
    return supervisor


def training_component(job_id: int, environ: Mapping[str, str]) -> tuple[int, tuple[str, ...]]:
    """The job id that holds the training nodes, and the srun options that reach them.

    tp-submit's heterogeneous job says which het group holds them
    (``TORCHPASS_TRAINING_HET_GROUP``); Slurm gives that component its own job id
    (``SLURM_JOB_ID_HET_GROUP_<g>``), which is the one ``scontrol update`` shrinks.
    """
    group = environ.get(cfg.ENV_TRAINING_HET_GROUP)
    if not group:
        return job_id, ()
    component = environ.get(f"SLURM_JOB_ID_HET_GROUP_{group}")
    if not (group.isdigit() and component and component.isdigit()):
        raise ConfigError(
            f"{cfg.ENV_TRAINING_HET_GROUP}={group} but this job has no het group {group} "
            f"(SLURM_JOB_ID_HET_GROUP_{group}={component!r})",
            hint="submit with tp-submit --supervisor-partition, or unset the variable",
        )
    return int(component), (f"--het-group={group}",)


#: The longest the job's rendezvous store parks one rank's get or wait.
STORE_MAX_WAIT = timedelta(minutes=5)


def _component_head_last(nodes: Sequence[str], head: str | None) -> list[str]:
    """The training component's first node last, so that it starts as a spare.

    Slurm gives each component of a heterogeneous job a batch host of its own, its first
    node, and refuses to shrink the component without it ("You cannot remove the batch host
    from a job when resizing", measured on 24.11.5); a node that cannot be released is best
    a spare, where a rank lives only once the other spares are used up.
    """
    ordered = list(nodes)
    head = head if head in ordered else (ordered[0] if ordered else None)
    if head is not None:
        ordered.remove(head)
        ordered.append(head)
    return ordered


def _ordered_nodes(nodes: Sequence[str], batch_host: str | None) -> list[str]:
    """The batch host first: it runs the supervisor, so it should never be a spare."""
    ordered = list(nodes)
    if batch_host in ordered:
        ordered.remove(batch_host)
        ordered.insert(0, batch_host)
    return ordered
