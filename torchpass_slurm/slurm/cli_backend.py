"""The default backend: Slurm's own commands, with JSON output where it exists.

Every operation builds an argument list and hands it to a
:class:`~torchpass_slurm.slurm.runner.Runner`; what comes back is parsed by
the pure functions of :mod:`~torchpass_slurm.slurm.parse`. ``sinfo --json`` and
``squeue --json`` ignore filter options on some releases, so filtering by node,
partition or job is done here, after parsing.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property

from torchpass_slurm.errors import SlurmCommandError, SlurmError, SlurmTimeoutError
from torchpass_slurm.slurm import hostlist
from torchpass_slurm.slurm.models import Job, Node, SlurmVersion
from torchpass_slurm.slurm.parse import (
    parse_job_id,
    parse_sinfo_json,
    parse_squeue_json,
    parse_version,
)
from torchpass_slurm.slurm.runner import CommandResult, Runner, SubprocessRunner
from torchpass_slurm.slurm.scontrol_text import parse_scontrol_job, parse_scontrol_nodes
from torchpass_slurm.slurm.steps import StepRequest, srun_argv, step_env

logger = logging.getLogger(__name__)

__all__ = ["CliSlurm"]

#: What salloc says once it has the allocation (on stderr): "salloc: Granted job allocation 42".
_GRANTED = re.compile(r"Granted job allocation (\d+)")
#: What Slurm says when it declines a job update only for now.
_NOT_YET = "try again"
#: A prolog run at allocation (``PrologFlags=Alloc``) is never run for a job grown by
#: expansion on Slurm 24.11: the merged node's first step waits 40 s for it, fails with
#: "Job prolog failed", and the node is drained (measured on the dev cluster).
EXPANSION_BLOCKER = "Alloc"

#: What makes the SPANK plugin add spares to a request; a refill's salloc must not carry it.
_SPARES_ENV = ("TORCHPASS_SPARES", "SPANK_TORCHPASS_SPARES")


def expansion_name(job_id: int) -> str:
    """The name of the one-node allocation that grows ``job_id`` (``tp-spare-JOB``)."""
    return f"tp-spare-{job_id}"


_JOB_GONE_HINT = (
    "the job may have ended and been purged from slurmctld (MinJobAge); "
    "`sacct -j {job_id}` shows its accounting record."
)


class CliSlurm:
    """Talks to Slurm through ``sinfo``, ``squeue``, ``scontrol``, ``sbatch``, ``srun``, ``scancel``."""

    name = "cli"

    def __init__(self, runner: Runner | None = None) -> None:
        self.runner: Runner = runner if runner is not None else SubprocessRunner()

    def _run(
        self,
        argv: Sequence[str],
        *,
        input: str | None = None,
        env: Mapping[str, str] | None = None,
        hint: str | None = None,
    ) -> CommandResult:
        """Run one command; on a non-zero exit, replace the generic hint by ``hint``."""
        try:
            return self.runner.run(argv, input=input, env=env)
        except SlurmTimeoutError:
            raise
        except SlurmCommandError as err:
            if hint is None:
                raise
            raise SlurmCommandError(
                err.argv, err.returncode, err.stderr, stdout=err.stdout, hint=hint
            ) from err

    # --- reading -----------------------------------------------------------

    def version(self) -> SlurmVersion:
        """The Slurm release of the client commands (``sinfo --version``)."""
        return self._version

    @cached_property
    def _version(self) -> SlurmVersion:
        return parse_version(self._run(["sinfo", "--version"]).stdout)

    def ping(self) -> bool:
        """True when a slurmctld answers ``scontrol ping``."""
        try:
            out = self._run(["scontrol", "ping"]).stdout
        except SlurmTimeoutError:
            raise
        except SlurmCommandError as err:
            out = err.stdout
            if "DOWN" not in out:
                raise
        return " is UP" in out

    def nodes(self, names: Iterable[str] | None = None, *, partition: str | None = None) -> tuple[Node, ...]:
        """Nodes as ``sinfo --json`` reports them, optionally only ``names`` / one partition."""
        nodes = self._load_nodes()
        if names is not None:
            wanted = set(names)
            nodes = tuple(n for n in nodes if n.name in wanted)
        if partition is not None:
            nodes = tuple(n for n in nodes if partition in n.partitions)
        return nodes

    def default_partition(self) -> str | None:
        """The partition a job without ``-p`` runs in (``Default=YES`` in ``scontrol show
        partition``), or None when there is none or Slurm does not say."""
        out = self._run(["scontrol", "show", "partition", "-o"]).stdout
        for line in out.splitlines():
            fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
            if fields.get("Default") == "YES" and fields.get("PartitionName"):
                return fields["PartitionName"]
        return None

    def _load_nodes(self) -> tuple[Node, ...]:
        """Every node; the one read a backend overrides."""
        return parse_sinfo_json(self._run(["sinfo", "--json"]).stdout)

    def node(self, name: str) -> Node:
        """One node; :class:`SlurmError` if Slurm does not know it."""
        found = self.nodes([name])
        if not found:
            raise SlurmError(
                f"Slurm knows no node named {name!r}",
                hint="`sinfo -N` lists the node names of this cluster.",
            )
        return found[0]

    def job(self, job_id: int) -> Job:
        """One job, with its CURRENT node list (``scontrol -o show job``)."""
        result = self._run(
            ["scontrol", "-o", "show", "job", str(job_id)],
            hint=_JOB_GONE_HINT.format(job_id=job_id),
        )
        return parse_scontrol_job(result.stdout)

    def jobs(self, job_ids: Iterable[int] | None = None, *, user: str | None = None) -> tuple[Job, ...]:
        """Jobs as ``squeue --json`` reports them, optionally only ``job_ids`` / one user's."""
        argv = ["squeue", "--json"]
        if user is not None:
            argv.append(f"--user={user}")
        jobs = parse_squeue_json(self._run(argv).stdout)
        if job_ids is not None:
            wanted = {int(j) for j in job_ids}
            jobs = tuple(j for j in jobs if j.job_id in wanted)
        return jobs

    # --- acting ------------------------------------------------------------

    def submit_batch(
        self,
        script: str | os.PathLike[str],
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> int:
        """Submit a batch script with ``sbatch --parsable``; return the job id.

        A ``str`` is the script's TEXT (given to sbatch on stdin); a path
        (``pathlib.Path`` or other ``os.PathLike``) is a script file. ``args``
        are sbatch options placed before the script; ``env`` adds variables to
        the environment sbatch sees (and, with the default ``--export=ALL``,
        the job).
        """
        argv = ["sbatch", "--parsable", *args]
        text: str | None = None
        if isinstance(script, str):
            text = script
        else:
            argv.append(os.fspath(script))
        full_env = {**os.environ, **env} if env else None
        result = self._run(argv, input=text, env=full_env)
        job_id = parse_job_id(result.stdout)
        logger.info("submitted batch job %d", job_id)
        return job_id

    def launch_step(self, step: StepRequest) -> subprocess.Popen[bytes]:
        """Start one ``srun --no-kill`` step on its node; return its process at once."""
        return self.runner.spawn(srun_argv(step), env=step_env(os.environ, step.env, step.unset_env))

    def drain(self, node: str, reason: str) -> None:
        """Drain ``node``: running work stays, nothing new starts. ``reason`` is required."""
        if not reason.strip():
            raise ValueError("drain: Slurm requires a reason to drain a node")
        self._run(["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"])
        logger.info("drained %s: %s", node, reason)

    def resume(self, node: str) -> None:
        """Undo a drain (``State=RESUME``)."""
        self._run(["scontrol", "update", f"NodeName={node}", "State=RESUME"])
        logger.info("resumed %s", node)

    def shrink_job(self, job_id: int, keep_nodes: Iterable[str]) -> None:
        """Release every node of a running job except ``keep_nodes``.

        Only the steps on released nodes are killed (with ``--no-kill``).
        """
        keep = list(keep_nodes)
        if not keep:
            raise ValueError("shrink_job: keep at least one node (use cancel() to end the job)")
        self._run(
            ["scontrol", "update", f"JobId={job_id}", f"NodeList={hostlist.compress(keep)}"],
            hint=_JOB_GONE_HINT.format(job_id=job_id),
        )
        logger.info("shrank job %d to %s", job_id, keep)

    def expand_job(self, job_id: int, *, wait_s: int, exclude: Iterable[str] = ()) -> tuple[str, ...]:
        """Grow the running job ``job_id`` by one node; the nodes it got (job expansion).

        ``salloc --no-shell -N1 --dependency=expand:JOB --immediate=WAIT_S`` in the job's
        partition, excluding its own nodes and ``exclude``; once granted, the one-node job
        gives its node to the job (``scontrol update JobId=NEW NumNodes=0``, then
        ``JobId=JOB NumNodes=ALL``). Needs ``SchedulerParameters=permit_job_expansion``.
        Raises SlurmError when Slurm refuses, or has no node within ``wait_s``.
        """
        job = self.job(job_id)
        avoid = sorted(set(job.nodes) | set(exclude))
        argv = ["salloc", "--no-shell", "-N1", f"--dependency=expand:{job_id}", f"--immediate={wait_s}"]
        argv.append(f"--job-name={expansion_name(job_id)}")
        if job.partition:
            argv.append(f"--partition={job.partition}")
        if avoid:
            argv.append(f"--exclude={hostlist.compress(avoid)}")
        # Not the job's own spares: the SPANK plugin would turn this one node into 1 + S
        # (measured: salloc inherited TORCHPASS_SPARES from the job and asked for 2 nodes).
        env = {k: v for k, v in os.environ.items() if k not in _SPARES_ENV}
        try:
            result = self.runner.run(argv, env=env, timeout=wait_s + 30)
        except SlurmError:
            # salloc withdraws its own request when --immediate runs out, not when it is killed
            # (a timeout here): a request left pending would hold a node for nobody once granted
            self.cancel_expansion(job_id)
            raise
        granted = _GRANTED.search(result.stderr + result.stdout)
        if granted is None:
            raise SlurmError(
                f"salloc granted no allocation to expand job {job_id}: {result.stderr.strip()[:300]}"
            )
        new_id = int(granted.group(1))
        try:
            nodes = self.job(new_id).nodes
            if set(nodes) & set(self.job(job_id).nodes):
                # Slurm shares a node between allocations: merging one the job holds already
                # takes a CPU from the job's count (measured on 24.11: 4 nodes, 3 CPUs), and the
                # steps of one of its nodes stay pending for good. Give it back instead.
                self.cancel(new_id)
                raise SlurmError(
                    f"salloc gave job {job_id} a node it holds already ({','.join(nodes)}): given back"
                )
            self._run(["scontrol", "update", f"JobId={new_id}", "NumNodes=0"])
            self._take_all(job_id, nodes)
        except SlurmError:
            self.cancel(new_id)  # never leave the node held by a job nobody uses
            raise
        self._drop_returned(job_id, set(exclude))
        logger.info("expanded job %d by %s (through job %d)", job_id, ",".join(nodes), new_id)
        return nodes

    def _take_all(self, job_id: int, nodes: Sequence[str]) -> None:
        """``scontrol update JobId=JOB NumNodes=ALL``, the merge's second half. Slurm 22.05
        without accounting refuses it for good ("the DB index is being set, try again in a
        bit"), but the first half has already moved the nodes into the job, where steps run
        (measured on the bookworm dev cluster): that refusal is no failure."""
        try:
            self._run(["scontrol", "update", f"JobId={job_id}", "NumNodes=ALL"])
        except SlurmError as err:
            if _NOT_YET not in str(err) or not set(nodes) <= set(self.job(job_id).nodes):
                raise
            logger.info("job %d holds %s already; Slurm declined NumNodes=ALL: %s", job_id, nodes, err)

    def _drop_returned(self, job_id: int, unwanted: set[str]) -> None:
        """Shrink ``job_id`` out of any of ``unwanted`` that the merge gave back to it.

        Measured on 24.11 (a fresh-clone CI run): a node the job had released by a shrink was
        in the job again after a later merge, and when Slurm set it DOWN it left the job and
        stayed ALLOCATED with no job once powered on."""
        nodes = self.job(job_id).nodes
        back = [n for n in nodes if n in unwanted]
        if back:
            logger.warning("the merge gave job %d back %s, which it had left: released again", job_id, back)
            self.shrink_job(job_id, [n for n in nodes if n not in unwanted])

    def cancel_expansion(self, job_id: int) -> None:
        """Withdraw a request to grow ``job_id`` (:meth:`expand_job`) that is still pending or
        granted but not merged: ``scancel --name`` its allocation. Nothing to withdraw is no
        error; a merged request has ended already (Slurm ends it as it moves its node)."""
        self._run(["scancel", f"--name={expansion_name(job_id)}"])

    def slurmd_started(self, names: Iterable[str]) -> dict[str, float]:
        """When slurmd last started on each of ``names`` that Slurm knows and says it of
        (epoch seconds; ``scontrol -o show node``): a node restarted after a loss is alive."""
        wanted = sorted(set(names))
        if not wanted:
            return {}
        out = self._run(["scontrol", "-o", "show", "node", hostlist.compress(wanted)]).stdout
        return {n.name: n.slurmd_started for n in parse_scontrol_nodes(out) if n.slurmd_started is not None}

    def config_value(self, key: str) -> str | None:
        """One setting of slurmctld's running configuration (``scontrol show config``), or None."""
        for line in self._run(["scontrol", "show", "config"]).stdout.splitlines():
            name, sep, value = line.partition("=")
            if sep and name.strip().lower() == key.lower():
                return value.strip()
        return None

    def cancel(self, job_id: int | str, *, signal: str | None = None) -> None:
        """``scancel`` the job, or send it ``signal`` (e.g. ``"USR1"``) instead."""
        argv = ["scancel"]
        if signal is not None:
            argv.append(f"--signal={signal}")
        argv.append(str(job_id))
        self._run(argv)
