"""``tp hostlist``: expand or compress a Slurm hostlist (no Slurm needed)."""

from __future__ import annotations

import click

from torchpass_slurm.slurm.hostlist import compress as compress_names
from torchpass_slurm.slurm.hostlist import expand as expand_expr


@click.group("hostlist")
def hostlist() -> None:
    """Expand or compress a Slurm hostlist, like `scontrol show hostnames`."""


@hostlist.command("expand")
@click.argument("expr")
def expand(expr: str) -> None:
    """Print the node names of EXPR (e.g. 'n[1-3],gpu01'), one per line."""
    for name in expand_expr(expr):
        click.echo(name)


@hostlist.command("compress")
@click.argument("names", nargs=-1, required=True)
def compress(names: tuple[str, ...]) -> None:
    """Print NAMES (e.g. n1 n2 n3) as one hostlist (n[1-3])."""
    click.echo(compress_names(names))
