"""``tp``: the torchpass-slurm command group.

Subcommands live one per file in this package and are imported only when they
are invoked (or when their own ``--help`` is asked for), so ``tp --help``
never pays for torch, mpi4py or rich.
"""

from __future__ import annotations

import importlib
import sys

import click

from torchpass_slurm import __version__
from torchpass_slurm.cli.app import App, run_cli

#: name -> (module, attribute, one-line help). The help is duplicated here so
#: that ``tp --help`` can list commands without importing them.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "nodes": ("torchpass_slurm.cli.nodes", "nodes", "Show the cluster's nodes as Slurm reports them."),
    "health": (
        "torchpass_slurm.cli.health",
        "health",
        "Node health checks and the Slurm hooks that drain bad nodes (admins).",
    ),
    "hostlist": ("torchpass_slurm.cli.hostlist", "hostlist", "Expand or compress a Slurm hostlist."),
    "status": ("torchpass_slurm.cli.status", "status", "Show a job's nodes, roles, ranks and heartbeats."),
    "events": (
        "torchpass_slurm.cli.events",
        "events",
        "Show a job's event log (faults, promotions, restarts).",
    ),
    "report": (
        "torchpass_slurm.cli.report",
        "report",
        "Show a job's faults, how each was resolved, the recovery times.",
    ),
    "drain": (
        "torchpass_slurm.cli.drain",
        "drain",
        "Drain a node and wait until jobs under tp run have moved off it.",
    ),
    "goodput": (
        "torchpass_slurm.cli.goodput",
        "goodput",
        "Expected training time ratio and lost GPU-hours: checkpoint restart against live migration.",
    ),
    "run": (
        "torchpass_slurm.cli.run",
        "run",
        "Run a command on the job's nodes under the supervisor (the drop-in for srun).",
    ),
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(COMMANDS))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in COMMANDS:
            module_name, attr, _ = COMMANDS[cmd_name]
            module = importlib.import_module(module_name)
            command = getattr(module, attr)
            if not isinstance(command, click.Command):
                raise TypeError(f"{module_name}.{attr} is not a click command")
            return command
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][2]) for name in sorted(COMMANDS)]
        rows += [
            (name, cmd.get_short_help_str())
            for name, cmd in sorted(self.commands.items())
            if name not in COMMANDS
        ]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(sorted(rows))


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-V", "--version", prog_name="torchpass-slurm")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
@click.option("-q", "--quiet", is_flag=True, help="Only errors on stderr.")
@click.option("--debug", is_flag=True, help="On an internal error, show its traceback on stderr too.")
@click.pass_context
def cli(ctx: click.Context, verbose: int, quiet: bool, debug: bool) -> None:
    """torchpass-slurm: hot spares and live migration for PyTorch training on Slurm.

    Submit with `tp-submit` (a drop-in for sbatch that adds --spares); inspect
    and operate jobs and nodes with the commands below.
    """
    app = ctx.ensure_object(App)  # run_cli's, which reads app.debug after an error
    app.verbose, app.quiet, app.debug = verbose, quiet, debug
    app.configure_logging()


def main() -> None:
    sys.exit(run_cli(cli, prog_name="tp"))


if __name__ == "__main__":
    main()
