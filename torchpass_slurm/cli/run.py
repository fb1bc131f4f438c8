"""``tp run COMMAND...``: the drop-in for ``srun COMMAND...`` inside a batch script.

It becomes the job's supervisor: one ``srun --no-kill`` step per node, hot
spares in standby, heartbeats over the authenticated control plane, a Slurm
watcher, the event log, and, when a node or a rank is lost, a live migration
of its state onto a spare (or an in-allocation restart from the last
checkpoint). Its exit status is the training's.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import click

from torchpass_slurm import config as cfg
from torchpass_slurm.cli.app import App, pass_app
from torchpass_slurm.errors import ConfigError


@click.command(
    context_settings={
        "ignore_unknown_options": True,
        "allow_interspersed_args": False,
        "help_option_names": ["-h", "--help"],
    }
)
@click.option(
    "--spares",
    type=click.IntRange(min=0),
    default=None,
    help="Hot-spare nodes among the job's nodes [env TORCHPASS_SPARES, default 0].",
)
@click.option(
    "--ntasks-per-node",
    type=click.IntRange(min=1),
    default=None,
    help="Ranks per node [env TORCHPASS_NTASKS_PER_NODE, SLURM_NTASKS_PER_NODE, 1].",
)
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="The job's output folder [env TORCHPASS_RUN_DIR, default ./torchpass-run-JOBID].",
)
@click.option(
    "--recovery",
    type=click.Choice(cfg.RECOVERY_MODES),
    envvar=cfg.ENV_RECOVERY,
    default="live",
    show_default=True,
    help="live: move a lost rank's state to a spare (trainings on the elastic loop); "
    "restart: restart every rank from the last checkpoint [env TORCHPASS_RECOVERY].",
)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@pass_app
def run(
    app: App,
    spares: int | None,
    ntasks_per_node: int | None,
    run_dir: Path | None,
    recovery: str,
    command: tuple[str, ...],
) -> None:
    """Run COMMAND on the job's nodes under the torchpass supervisor.

    Use it inside a batch script where you would write `srun COMMAND`. The
    job's first nodes hold the ranks; the last --spares nodes wait in standby
    and take over a lost node's ranks. Submit with `tp-submit`, which asks
    Slurm for the extra nodes and sets everything up.
    """
    from torchpass_slurm.supervisor.assemble import build_supervisor

    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        raise ConfigError(
            "tp run must run inside a Slurm job (SLURM_JOB_ID is not set)",
            hint="put `tp run COMMAND` in a batch script and submit it with tp-submit",
        )
    if command and command[0] == "--":
        command = command[1:]
    spares = spares if spares is not None else cfg.env_int(cfg.ENV_SPARES, 0)
    k = ntasks_per_node or cfg.env_int(
        cfg.ENV_NTASKS_PER_NODE, cfg.env_int("SLURM_NTASKS_PER_NODE", 1, minimum=1), minimum=1
    )
    run_dir = run_dir or Path(os.environ.get(cfg.ENV_RUN_DIR) or f"torchpass-run-{job_id}")
    supervisor = build_supervisor(
        job_id=int(job_id),
        command=command,
        spares=spares,
        ntasks_per_node=k,
        run_dir=run_dir.resolve(),
        host=socket.gethostname(),
        recovery=recovery,
    )
    try:
        result = supervisor.run()
    finally:
        if supervisor.keepalive is not None:
            supervisor.keepalive.close()
    click.echo(
        f"tp run: {result.message} (exit {result.exit_code}, epoch {result.epoch}, "
        f"restarts {result.restarts})",
        err=True,
    )
    raise SystemExit(result.exit_code)
