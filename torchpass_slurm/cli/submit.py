"""``tp-submit``: sbatch with hot spares.

A thin shell around :mod:`torchpass_slurm.submit`: it reads the script, looks
at this node and at Slurm, and prints. sbatch's options are not click options
(there are a hundred, and unknown ones must pass through in order), so the
whole argument list goes to :func:`~torchpass_slurm.submit.parse_submit_args`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import click

from torchpass_slurm.cli.app import App, pass_app, run_cli
from torchpass_slurm.errors import SlurmError, SubmitError
from torchpass_slurm.submit import (
    BatchScript,
    JobSpec,
    SubmitRequest,
    Submitter,
    check_command,
    check_partition_fits,
    check_run_dir,
    check_script_interpreter,
    describe_layout,
    parse_submit_args,
    partition_unknown_warning,
    read_batch_script,
    render_batch_script,
    resolve_job_spec,
    sbatch_command_line,
    submit,
)
from torchpass_slurm.submit.placement import load_site_tables

#: Said once per user (a marker under XDG_STATE_HOME) when no supervisor partition is set.
NOT_REPLACEABLE_NOTE = (
    "note: no supervisor partition is configured, so the supervisor runs on the node of rank 0 "
    "and that node cannot be replaced: if it dies the job ends (tp report names the cause), "
    "and a drain of it waits for the job's end. Ask your admins for a service partition, or "
    'give --supervisor-partition P (docs/user-guide.md, "Where the supervisor runs"). '
    "This note is shown once."
)

#: sbatch's own environment variable for the partition (used when -p is not given).
SBATCH_PARTITION_ENV = "SBATCH_PARTITION"

HELP = """Submit a training job with hot-spare nodes: sbatch, plus --spares.

\b
  tp-submit [SBATCH OPTIONS] [--spares S] SCRIPT [ARGS...]
  tp-submit [SBATCH OPTIONS] [--spares S] -- COMMAND...

tp-submit asks sbatch for N+S nodes with --no-kill: N active nodes (-N) and S
hot spares that take over a failing node's work. In SCRIPT, start the training
with `tp run COMMAND` where plain sbatch would use `srun COMMAND`. With
`-- COMMAND...` no script is needed: the job runs `tp run -- COMMAND...`.

Options come from the command line and from the #SBATCH lines at the top of
SCRIPT (tp-submit's own options from `#TP --spares=S` lines); the command line
wins. Every sbatch option tp-submit does not list below goes to sbatch
unchanged, in order.

\b
tp-submit's options:
  --spares S          hot-spare nodes, in addition to -N (default 0)
  --spare-wait SECONDS
                      with no spare left, how long the job holds its step
                      in memory for Slurm to give it a node, when a replica
                      still holds the lost state (default 300; 0: never)
  --supervisor-partition P
                      run the supervisor in its own small component of a
                      heterogeneous job in partition P, so that every
                      training node can be replaced (default: the site's
                      [supervisor] partition in /etc/torchpass/submit.toml
                      or TORCHPASS_SUBMIT_CONFIG; `none`: on the node of
                      rank 0, which cannot be replaced)
  --transport T       what carries a live migration's state: auto (a replica
                      over the training's torch group, a leaving rank over a
                      socket), torch, socket or mpi (MPICH connect/accept
                      in a helper process of each end); default: TORCHPASS_TRANSPORT,
                      else the site's [transfer] transport, else auto
  --run-dir DIR       the job's folder on the shared file system (secret,
                      events, checkpoints, output); default:
                      ./torchpass-runs/<job-name>-<YYYYmmdd-HHMMSS>,
                      relative to --chdir or the current directory
  --dry-run           print the sbatch command and the batch script;
                      submit nothing, create nothing
  --parsable          print only the job id (as sbatch --parsable)
  --debug             on an internal error, show its traceback on stderr
                      too (it is always written to a log file)
  -h, --help          show this message

\b
sbatch options that tp-submit reads:
  -N, --nodes N       active nodes (a fixed count; default 1)
  --ntasks-per-node K ranks per node (default 1, or -n / N)
  -n, --ntasks T      total ranks; must equal N x K
  -p, --partition P   checked: N+S nodes must fit in P
  -o, --output FILE   default: <run dir>/slurm-%j.out
  -J, --job-name NAME default: the script's (or command's) file name
  -D, --chdir DIR     the job's working directory
  -k, --no-kill       always passed; tp needs it

\b
Examples:
  tp-submit -N 4 --spares 1 train.sbatch
  tp-submit -N 2 --ntasks-per-node 4 --spares 1 -t 1:00:00 -- python train.py
"""


def make_submitter() -> Submitter:
    """The real Submitter: the package's Slurm backend (imported only when submitting)."""
    from torchpass_slurm.slurm import select_backend

    return SlurmSubmitter(select_backend())


def load_create_secret() -> Callable[[Path], Path]:
    from torchpass_slurm.control.secret import create_secret

    return create_secret


def secret_subpath() -> str:
    """Where create_secret puts the secret inside the run dir."""
    from torchpass_slurm.control.secret import SECRET_DIR, SECRET_NAME

    return os.path.join(SECRET_DIR, SECRET_NAME)


class SlurmSubmitter:
    """:class:`~torchpass_slurm.submit.Submitter` over a ``torchpass_slurm.slurm`` backend."""

    def __init__(self, slurm: Any) -> None:
        self.slurm = slurm

    def submit_batch(self, script: str, sbatch_args: Sequence[str]) -> str:
        return str(self.slurm.submit_batch(script, list(sbatch_args)))

    def partition_node_count(self, partition: str | None) -> int | None:
        """Nodes in ``partition``; without one, in the default partition (``scontrol show
        partition``: ``sinfo --json`` does not mark it), else in the whole cluster (a bound on
        it: a service partition beside the default one makes that bound too loose). None:
        Slurm knows no such partition."""
        if partition is None:
            default = getattr(self.slurm, "default_partition", None)
            partition = default() if callable(default) else None
        return len(self.slurm.nodes(partition=partition)) or None


class SubmitCommand(click.Command):
    """Hands the whole argument list to parse_submit_args: sbatch's options are not click's."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.params = {"argv": tuple(args)}
        ctx.args = []
        return []

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        return ["[OPTIONS] SCRIPT [ARGS]...  |  [OPTIONS] -- COMMAND..."]


def _given(name: str, request: SubmitRequest, script: BatchScript | None) -> bool:
    return request.has(name) or any(o.name == name for o in (script.directives if script else ()))


def _check(
    request: SubmitRequest, spec: JobSpec, submitter: Submitter, *, cwd: str, run_dir_given: bool
) -> None:
    """Everything that can be refused before a job exists."""
    if spec.command:
        check_command(spec.command, os.path.join(cwd, spec.chdir) if spec.chdir else cwd)
    if run_dir_given:  # a default run dir that is taken gets a numbered name instead
        check_run_dir(spec.run_dir)
    partition = spec.partition or os.environ.get(SBATCH_PARTITION_ENV) or None
    try:
        count = submitter.partition_node_count(partition)
    except SlurmError as err:
        if not request.dry_run:
            raise
        click.echo(f"warning: could not check the partition's size: {err.message}", err=True)
        return
    if count is None:  # refused when known (below); said when not, never silently accepted
        click.echo(partition_unknown_warning(spec, partition), err=True)
    check_partition_fits(spec, partition, count)
    if spec.supervisor is not None and submitter.partition_node_count(spec.supervisor.partition) is None:
        raise SubmitError(
            f"the supervisor partition {spec.supervisor.partition!r} (from {spec.supervisor.origin}) "
            "is not a partition Slurm knows",
            hint="check `sinfo -s`, or give --supervisor-partition none to run the supervisor on "
            "the node of rank 0",
        )


def note_marker() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "torchpass" / "supervisor-note-shown"


def say_not_replaceable_once() -> None:
    """The note, unless this user has seen it (marker file); said anyway if no marker can be made."""
    marker = note_marker()
    if marker.exists():
        return
    click.echo(NOT_REPLACEABLE_NOTE, err=True)
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:
        pass


@click.command(cls=SubmitCommand, help=HELP, context_settings={"help_option_names": []})
@pass_app
def tp_submit(app: App, argv: tuple[str, ...]) -> None:
    request = parse_submit_args(argv)
    app.debug = request.has("debug")
    if request.help:
        click.echo(click.get_current_context().get_help())
        return
    cwd = os.getcwd()
    script = None
    if request.script is not None:
        script = read_batch_script(request.script, cwd)
        check_script_interpreter(script)
    site, site_path = load_site_tables()
    spec = resolve_job_spec(
        request,
        script,
        cwd=cwd,
        now=datetime.now(),
        secret_subpath=secret_subpath(),
        environ=os.environ,
        site=site.get("supervisor", {}),
        site_path=site_path,
        site_transport=site.get("transfer", {}).get("transport"),
    )
    run_dir_given = _given("run-dir", request, script)
    submitter = make_submitter()
    _check(request, spec, submitter, cwd=cwd, run_dir_given=run_dir_given)
    if spec.supervisor is None:
        say_not_replaceable_once()
    if request.dry_run:
        click.echo("# tp-submit --dry-run: nothing was submitted, nothing was created.")
        click.echo("# The sbatch command (the script below goes to its stdin):")
        click.echo(sbatch_command_line(spec))
        click.echo("# The batch script:")
        click.echo(render_batch_script(spec), nl=False)
        return
    result = submit(spec, submitter, load_create_secret(), rename_if_taken=not run_dir_given)
    if _given("parsable", request, script):
        click.echo(result.job_id)
    else:
        click.echo(
            f"Submitted batch job {result.job_id} ({describe_layout(result.spec)}; "
            f"run dir: {result.spec.run_dir})"
        )


def main() -> None:
    sys.exit(run_cli(tp_submit, prog_name="tp-submit"))


if __name__ == "__main__":
    main()
