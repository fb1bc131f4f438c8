"""``tp drain NODE --reason TEXT``: drain a node and wait until the job has moved off it.

The drain is Slurm's own (``scontrol update nodename=NODE state=drain``); a
job running under ``tp run`` sees it within its poll interval, moves the
node's ranks to a hot spare at the next step boundary and releases the node.
This command shows that happen and returns once the node is DRAINED (idle,
free for maintenance), or fails after ``--timeout`` seconds.
"""

from __future__ import annotations

import time

import click

from torchpass_slurm.cli.app import App, pass_app
from torchpass_slurm.errors import TorchpassError

#: Seconds between two looks at the node.
POLL_INTERVAL_S = 2.0


def _reason(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """The drain reason as given: Slurm needs one, and keeps it on one line."""
    if not value.strip():
        raise click.BadParameter("must not be blank; say why the node is drained (Slurm requires a reason)")
    bad = sorted({repr(c) for c in value if not c.isprintable()})
    if bad:
        raise click.BadParameter(f"holds the control character(s) {', '.join(bad)}; use one line of text")
    return value


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("node")
@click.option("--reason", required=True, callback=_reason, help="Why: Slurm keeps it with the drain.")
@click.option(
    "--timeout",
    type=click.FloatRange(min=1),
    default=900.0,
    show_default=True,
    help="Seconds to wait for the node to become DRAINED.",
)
@click.option("--no-wait", is_flag=True, help="Drain and return at once.")
@pass_app
def drain(app: App, node: str, reason: str, timeout: float, no_wait: bool) -> None:
    """Drain NODE; wait until running jobs have moved off it and it is DRAINED."""
    from torchpass_slurm.slurm import select_backend

    slurm = select_backend()
    slurm.node(node)  # a clear error for a node Slurm does not know
    slurm.drain(node, reason)
    app.err_console.print(f"{node}: drain requested ({reason})")
    if no_wait:
        return
    deadline = time.monotonic() + timeout
    last = ""
    with app.err_console.status(f"waiting for {node} to be DRAINED") as status:
        while True:
            current = slurm.node(node)
            if current.state_text != last:
                last = current.state_text
                app.err_console.print(f"{time.strftime('%H:%M:%S')}  {node}: {last}")
                status.update(f"waiting for {node} to be DRAINED (now {last})")
            if current.is_drained:
                break
            if time.monotonic() > deadline:
                raise TorchpassError(
                    f"{node} is still {last} after {timeout:g} s",
                    hint="a job not running under tp run keeps the node until it ends; see `squeue -w NODE`",
                )
            time.sleep(POLL_INTERVAL_S)
    click.echo(f"{node} is DRAINED: free for maintenance")
