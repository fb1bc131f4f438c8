"""JobSpec: every value tp-submit decides about one job, from its command line and script (pure).

Precedence is sbatch's: the command line wins over the script's ``#SBATCH`` /
``#TP`` lines, and for an option given twice the later one wins.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from torchpass_slurm.config import ENV_TRANSPORT, check_transport
from torchpass_slurm.errors import ConfigError, SubmitError
from torchpass_slurm.submit.batch_script import BatchScript
from torchpass_slurm.submit.command_line import SubmitRequest
from torchpass_slurm.submit.options import COMMAND_LINE, UNDERSTOOD, Option
from torchpass_slurm.submit.placement import SITE_CONFIG, SupervisorPlacement, resolve_placement

__all__ = ["JobSpec", "MAX_NODES", "absolute_path", "resolve_job_spec"]

#: The most nodes (active + spares) one job may ask for: beyond any Slurm cluster, and far
#: below what would overflow a count (``--spares 99999999999999999999`` is refused, not rendered).
MAX_NODES = 1_000_000


@dataclass(frozen=True)
class JobSpec:
    """Everything tp-submit decided about one job; the input of the rendering."""

    #: Active nodes N, hot spares S, ranks per node k. sbatch gets N+S nodes.
    nodes: int
    spares: int
    ntasks_per_node: int
    job_name: str
    #: Absolute paths on the shared file system.
    run_dir: str
    secret_file: str
    #: What the script or command was given as, for the header ("train.sh", "the command line").
    source: str
    #: Script mode: the user's #! line, the rest of the script and its arguments.
    shebang: str = "#!/bin/bash"
    body: str = ""
    script_args: tuple[str, ...] = ()
    #: Command mode: the command ``tp run`` starts on every node (non-empty in this mode).
    command: tuple[str, ...] = ()
    partition: str | None = None
    #: sbatch's --output as the user gave it; None: ``RUN_DIR/slurm-%j.out``.
    output: str | None = None
    chdir: str | None = None
    #: sbatch's --comment as the user gave it; None: ``torchpass:run_dir=RUN_DIR``.
    comment: str | None = None
    #: Options for sbatch that tp-submit does not interpret, as written, in order.
    sbatch_passthrough: tuple[str, ...] = field(default_factory=tuple)
    #: The supervisor's own component of a heterogeneous job; None: the batch host is
    #: the node of rank 0 (and cannot be replaced).
    supervisor: SupervisorPlacement | None = None
    #: ``--spare-wait``: seconds the job may hold its step for a spare (TORCHPASS_SPARE_WAIT);
    #: None: the setting's default or environment.
    spare_wait: float | None = None
    #: ``--transport``, else TORCHPASS_TRANSPORT, else the site file's ``[transfer] transport``
    #: (config.ENV_TRANSPORT), checked; None: none of them, the ranks use ``auto``.
    transport: str | None = None

    @property
    def total_nodes(self) -> int:
        return self.nodes + self.spares


def _last(options: Sequence[Option], name: str) -> Option | None:
    for option in reversed(options):
        if option.name == name:
            return option
    return None


def _count(option: Option | None, what: str, *, minimum: int) -> int | None:
    if option is None:
        return None
    value = (option.value or "").strip()
    if not (value.isascii() and value.isdigit()):
        raise SubmitError(f"{what} must be a whole number, got {option}")
    if int(value) < minimum:
        raise SubmitError(f"{what} must be at least {minimum}, got {option}")
    return int(value)


#: The longest --spare-wait tp-submit accepts: a week (seconds).
MAX_SPARE_WAIT_S = 7 * 24 * 3600


def _seconds(option: Option | None, what: str) -> float | None:
    """A number of seconds, 0 or more (at most :data:`MAX_SPARE_WAIT_S`), or None if not given."""
    if option is None:
        return None
    try:
        value = float(option.value or "")
    except ValueError:
        value = -1.0
    if not 0 <= value <= MAX_SPARE_WAIT_S:  # NaN too
        raise SubmitError(
            f"{what}={option.value!r} (from {option.origin}) is not a number of seconds from 0 to "
            f"{MAX_SPARE_WAIT_S}",
            hint="e.g. --spare-wait 300; 0 ends the job at once when no spare is left",
        )
    return value


def _transport(option: Option | None, environ: Mapping[str, str], site: Any, site_path: str) -> str | None:
    """The job's transport by the precedence command line > environment > site file; None: unset."""
    if option is not None:
        try:
            return check_transport(option.value or "", f"--transport={option.value!r} (from {option.origin})")
        except ConfigError as err:
            raise SubmitError(err.message, hint=err.hint) from None
    raw = environ.get(ENV_TRANSPORT)
    if raw is not None and raw.strip():
        return check_transport(raw, f"{ENV_TRANSPORT}={raw!r}")
    if site is not None:
        if not isinstance(site, str):
            raise ConfigError(f"{site_path}: [transfer] transport must be a string, got {site!r}")
        return check_transport(site, f"{site_path}: [transfer] transport")
    return None


def _node_count(option: Option | None) -> int | None:
    if option is None:
        return None
    m = re.fullmatch(r"\s*([0-9]+)\s*(?:-\s*([0-9]+)\s*)?", option.value or "")
    if m is None:
        raise SubmitError(
            f"{option}: the node count must be a whole number, not {option.value!r}",
            hint="tp needs a fixed number of active nodes, e.g. -N 4",
        )
    low, high = int(m.group(1)), int(m.group(2) or m.group(1))
    if low != high:
        raise SubmitError(
            f"{option}: a range of node counts ({low} to {high}) is not supported",
            hint=f"tp needs a fixed number of active nodes: give one number, e.g. -N {high}, "
            "and add hot spares with --spares",
        )
    if low < 1:
        raise SubmitError(f"{option}: the job needs at least 1 node")
    return low


def _layout(options: Sequence[Option]) -> tuple[int, int]:
    """(N, k) from -N, -n and --ntasks-per-node; every node runs the same k ranks."""
    nodes_opt, ntasks_opt, per_node_opt = (
        _last(options, "nodes"),
        _last(options, "ntasks"),
        _last(options, "ntasks-per-node"),
    )
    nodes = _node_count(nodes_opt)
    ntasks = _count(ntasks_opt, "the number of tasks", minimum=1)
    per_node = _count(per_node_opt, "the number of tasks per node", minimum=1)
    if ntasks is None:
        return nodes or 1, per_node or 1
    if nodes is None:
        if per_node is None:
            raise SubmitError(
                f"{ntasks_opt} alone does not say how many nodes the job needs",
                hint="give -N/--nodes too (or --ntasks-per-node)",
            )
        nodes = ntasks // per_node
        if nodes * per_node != ntasks:
            raise SubmitError(
                f"{ntasks_opt} is not a multiple of {per_node_opt}",
                hint="tp runs the same number of tasks on every node",
            )
        return nodes, per_node
    if per_node is None:
        if ntasks % nodes:
            raise SubmitError(
                f"{ntasks_opt} tasks do not spread evenly over {nodes_opt} nodes",
                hint="tp runs the same number of tasks on every node",
            )
        return nodes, ntasks // nodes
    if ntasks != nodes * per_node:
        raise SubmitError(
            f"conflicting task counts: {ntasks_opt} but {nodes_opt} x {per_node_opt} = {nodes * per_node}",
            hint="drop -n/--ntasks: tp-submit derives it from -N and --ntasks-per-node",
        )
    return nodes, per_node


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "job"


def absolute_path(path: str, base: str) -> str:
    """``path`` (``~`` expanded) made absolute against ``base``, normalized."""
    return os.path.normpath(os.path.join(base, os.path.expanduser(path)))


def _refuse_unsupported(options: Sequence[Option]) -> None:
    for option in options:
        if option.name == "wrap":
            raise SubmitError(
                f"{option}: tp-submit does not take --wrap",
                hint="write the command after `--`: tp-submit [OPTIONS] -- COMMAND...",
            )
        if option.name == "no-kill" and option.value not in (None, ""):
            raise SubmitError(
                f"{option}: tp needs --no-kill (a lost node must not end the job)",
                hint="remove it; tp-submit always passes --no-kill",
            )


def _value(options: Sequence[Option], name: str) -> str | None:
    option = _last(options, name)
    return None if option is None else option.value


def _run_dir(options: Sequence[Option], job_name: str, *, cwd: str, now: datetime) -> str:
    """``--run-dir`` (relative to ``cwd``), else ``torchpass-runs/NAME-TIME`` in the job's workdir."""
    given = _value(options, "run-dir")
    if given:
        return absolute_path(given, cwd)
    chdir = _value(options, "chdir")
    workdir = absolute_path(chdir, cwd) if chdir else cwd
    return os.path.join(workdir, "torchpass-runs", f"{_safe_name(job_name)}-{now:%Y%m%d-%H%M%S}")


def resolve_job_spec(
    request: SubmitRequest,
    script: BatchScript | None,
    *,
    cwd: str,
    now: datetime,
    secret_subpath: str = ".torchpass/secret",
    environ: Mapping[str, str] | None = None,
    site: Mapping[str, Any] | None = None,
    site_path: str = str(SITE_CONFIG),
    site_transport: str | None = None,
) -> JobSpec:
    """Merge the command line over the script's directives and decide every value (pure).

    ``cwd`` is the directory tp-submit runs in, ``now`` names the default run dir,
    ``secret_subpath`` is where :func:`~torchpass_slurm.control.secret.create_secret`
    will put the secret in the run dir. ``environ`` and ``site`` (the site file's
    ``[supervisor]`` table, read from ``site_path``) place the supervisor
    (:func:`~torchpass_slurm.submit.placement.resolve_placement`); ``environ`` and
    ``site_transport`` (its ``[transfer] transport``) give the transport under ``--transport``.
    """
    options = (*(script.directives if script else ()), *request.options)
    _refuse_unsupported(options)
    nodes, per_node = _layout(options)
    spares = _count(_last(options, "spares"), "the number of hot spares", minimum=0) or 0
    if script is not None:
        job_name = _value(options, "job-name") or os.path.basename(script.source)
    else:
        job_name = _value(options, "job-name") or os.path.basename(request.command[0])
    run_dir = _run_dir(options, job_name, cwd=cwd, now=now)
    passthrough = tuple(w for o in options if o.name not in UNDERSTOOD for w in o.tokens)
    spec = JobSpec(
        nodes=nodes,
        spares=spares,
        ntasks_per_node=per_node,
        job_name=job_name,
        run_dir=run_dir,
        secret_file=os.path.join(run_dir, secret_subpath),
        source=script.source if script else COMMAND_LINE,
        partition=_value(options, "partition"),
        output=_value(options, "output"),
        chdir=_value(options, "chdir"),
        comment=_value(options, "comment"),
        sbatch_passthrough=passthrough,
        supervisor=resolve_placement(
            _value(options, "supervisor-partition"), environ or {}, site or {}, site_path
        ),
        spare_wait=_seconds(_last(options, "spare-wait"), "--spare-wait"),
        transport=_transport(_last(options, "transport"), environ or {}, site_transport, site_path),
    )
    _refuse_control_characters(spec)
    if spec.total_nodes > MAX_NODES:
        raise SubmitError(
            f"{spec.nodes} active nodes + {spec.spares} hot spares is {spec.total_nodes} nodes; "
            f"tp-submit allows at most {MAX_NODES:,}",
            hint="check -N and --spares",
        )
    if script is not None:
        return replace(spec, shebang=script.shebang, body=script.body, script_args=request.script_args)
    return replace(spec, command=request.command)


def _refuse_control_characters(spec: JobSpec) -> None:
    """Every name that goes into the batch script, or to sbatch, is one line of text: a newline in
    a script's path or a partition would start a line of its own in the rendered script."""
    names = {
        "the script's path": spec.source,
        "the job name": spec.job_name,
        "the partition": spec.partition,
        "the supervisor's partition": spec.supervisor.partition if spec.supervisor else None,
        "--output": spec.output,
        "--chdir": spec.chdir,
        "--comment": spec.comment,
        "the run folder": spec.run_dir,  # last: it derives from --chdir and the job name
    }
    for what, value in names.items():
        bad = sorted({repr(c) for c in value or "" if not c.isprintable()})
        if bad:
            raise SubmitError(
                f"{what} {value!r} holds the control character(s) {', '.join(bad)}",
                hint="names in a batch script are one line of printable text: rename it",
            )
