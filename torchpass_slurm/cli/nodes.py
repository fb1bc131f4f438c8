"""``tp nodes``: the cluster's nodes as Slurm reports them (a table, or JSON)."""

from __future__ import annotations

import json
from collections.abc import Sequence

import click

from torchpass_slurm.cli.app import App, pass_app
from torchpass_slurm.slurm import Node, select_backend


def nodes_as_json(nodes: Sequence[Node]) -> str:
    """The ``--json`` document: a list of objects, flags and partitions as sorted lists."""
    rows = [
        {
            "name": n.name,
            "state": n.state,
            "flags": sorted(n.flags),
            "reason": n.reason,
            "partitions": list(n.partitions),
            "cpus": n.cpus,
        }
        for n in nodes
    ]
    return json.dumps(rows, indent=2)


@click.command("nodes")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("-p", "--partition", metavar="P", help="Only nodes of partition P.")
@pass_app
def nodes(app: App, as_json: bool, partition: str | None) -> None:
    """Show the cluster's nodes as Slurm reports them: state, flags, reason, partitions."""
    found = select_backend().nodes(partition=partition)
    if as_json:
        click.echo(nodes_as_json(found))
        return
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE, show_edge=False)
    for column in ("NODE", "STATE", "FLAGS", "REASON", "PARTITIONS"):
        table.add_column(column, overflow="fold")
    for n in found:
        table.add_row(n.name, n.state, ",".join(sorted(n.flags)), n.reason or "", ",".join(n.partitions))
    app.console.print(table)
