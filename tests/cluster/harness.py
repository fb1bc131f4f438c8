"""A thin test-side handle on the dockerized Slurm cluster (scripts/cluster).

Every action goes through ``scripts/cluster`` or ``docker exec`` into the
controller, so the tests exercise exactly what a developer runs by hand.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "cluster"
COMPUTE = ("c1", "c2", "c3", "c4", "c5")
#: Slurm marks a silent node DOWN after SlurmdTimeout (30 s in docker/slurm.conf);
#: the controller pings nodes periodically, so allow a generous margin.
SLURMD_TIMEOUT_S = 30.0
DOWN_MARGIN_S = 60.0

T = TypeVar("T")


class ClusterTestError(AssertionError):
    """A cluster action failed; the message carries what the command said."""


@dataclass
class Cluster:
    """The running test cluster as seen from the host."""

    shared_host: Path
    shared_node: str = "/shared"

    # -- running things ---------------------------------------------------
    def script(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise ClusterTestError(f"scripts/cluster {' '.join(args)} failed ({proc.returncode}):\n"
                                   f"{proc.stdout}\n{proc.stderr}")
        return proc

    def exec(self, node: str, *cmd: str, timeout: float = 120, check: bool = True,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        env_args = [a for k, v in (env or {}).items() for a in ("-e", f"{k}={v}")]
        proc = subprocess.run(["docker", "exec", *env_args, f"torchpass-{node}", *cmd],
                              capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise ClusterTestError(f"on {node}: {' '.join(cmd)} failed ({proc.returncode}):\n"
                                   f"stdout: {proc.stdout}\nstderr: {proc.stderr}")
        return proc

    # -- Slurm's view -----------------------------------------------------
    def node_states(self) -> dict[str, str]:
        """Node -> long state as `sinfo -N -o %T` prints it, e.g. idle, down*, idle*."""
        out = self.exec("ctl", "sinfo", "-h", "-N", "-o", "%N %T").stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def node_json(self, node: str) -> dict:
        out = self.exec("ctl", "scontrol", "--json", "show", "node", node).stdout
        return json.loads(out)["nodes"][0]

    def job_field(self, job_id: str, field: str) -> str:
        out = self.exec("ctl", "scontrol", "-o", "show", "job", job_id).stdout
        m = re.search(rf"(?:^|\s){field}=(\S*)", out)
        if not m:
            raise ClusterTestError(f"no {field}= in `scontrol show job {job_id}`: {out}")
        return m.group(1)

    def sbatch(self, *args: str) -> str:
        out = self.exec("ctl", "sbatch", "--parsable", *args).stdout.strip()
        return out.split(";")[0]

    def wait_job_done(self, job_id: str, timeout: float = 180) -> str:
        return wait_for(lambda: self._finished_state(job_id), timeout=timeout,
                        what=f"job {job_id} to finish")

    def _finished_state(self, job_id: str) -> str | None:
        state = self.job_field(job_id, "JobState")
        return state if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING") else None

    # -- faults -----------------------------------------------------------
    def kill(self, node: str) -> None:
        self.script("kill", node)

    def restart(self, node: str) -> None:
        self.script("restart", node)

    def partition(self, node: str) -> None:
        self.script("partition", node)

    def heal(self, node: str) -> None:
        self.script("heal", node)

    def ensure_healthy(self, timeout: float = 180) -> None:
        """Bring every compute node back to idle: no jobs left, nodes restarted, healed, resumed."""
        self.exec("ctl", "scancel", "--full", "--user=root", check=False)
        running = subprocess.run(
            ["docker", "ps", "--filter", "name=^torchpass-", "--format", "{{.Names}}"],
            capture_output=True, text=True, timeout=30).stdout.split()
        for node in COMPUTE:
            if f"torchpass-{node}" not in running:
                self.restart(node)
            else:
                # Reconnects a node a test cut off; exits non-zero (ignored) when attached.
                self.script("heal", node, check=False)
        def all_idle() -> bool:
            states = self.node_states()
            for node, state in states.items():
                if state.startswith(("down", "drain")):
                    self.exec("ctl", "scontrol", "update", f"nodename={node}", "state=resume",
                              check=False)
            return all(states.get(n) == "idle" for n in COMPUTE)
        wait_for(lambda: all_idle() or None, timeout=timeout, what="every node idle")

    def read_shared(self, relpath: str) -> str:
        return (self.shared_host / relpath).read_text()


def wait_for(probe: Callable[[], T | None], *, timeout: float, what: str,
             interval: float = 1.0) -> T:
    """Poll ``probe`` until it returns a truthy value; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise ClusterTestError(f"timed out after {timeout:g} s waiting for {what} (last: {last!r})")


def shared_dir() -> Path:
    return Path(os.environ.get("TP_CLUSTER_SHARED", ROOT / ".cluster" / "shared")).resolve()
