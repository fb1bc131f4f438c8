"""The one driver of the dockerized Slurm dev cluster (docs/dev-cluster.md).

It builds the images, brings the cluster up and down, runs commands on its
nodes, reads Slurm's and tp's view of it, injects faults (power loss, network
cut) and repairs them. Its users: the ``scripts/cluster`` command line, the
cluster tests (``tests/cluster/``) and the benchmarks (``benchmarks/``), all
through :class:`Cluster`.

Standard library only (Python 3.9+), so ``scripts/cluster`` runs with any
python3. Settings (environment, read at import): TP_CLUSTER_FLAVOR, TP_CLUSTER_PROJECT
(the container name prefix), TP_CLUSTER_IMAGE,
TP_CLUSTER_SHARED (host folder mounted at /shared on every node),
TP_CLUSTER_NET_PREFIX (first three octets of the cluster's /24, default
172.29.77), TP_CLUSTER_NETWORK, TP_CLUSTER_BASE_MIRROR (Debian mirror for
debootstrap).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent
DOCKER_DIR = ROOT / "docker"
COMPOSE_FILE = DOCKER_DIR / "compose.yml"
CONTROLLER = "ctl"
COMPUTE = ("c1", "c2", "c3", "c4", "c5")
#: The service partition's node (partition ``service``): where a job's supervisor
#: component runs when tp-submit is given a supervisor partition. Not in ``debug``.
SERVICE = ("s1",)
SERVICE_PARTITION = "service"
NODES = (CONTROLLER, *COMPUTE, *SERVICE)


@dataclass(frozen=True)
class Flavor:
    """One kind of dev cluster: its Debian release, images, names and network.

    ``trixie`` (the default): Slurm 24.11, Debian's torch 2.6. ``bookworm``: Slurm 22.05
    (the oldest Slurm the project supports) with torch 2.13 (CPU): Debian's torch 2.6
    cannot run FSDP2 (design.md, 1b). Both take MPICH 5 and mpi4py 4.1 (the MPI transport
    under ``srun --mpi=pmi2``) from a wheelhouse the host's pip fills (``wheels``, a
    requirements file under docker/, for the flavor's ``python``). The two differ in every
    name, address and folder, so both can be up at once.
    """

    name: str
    suite: str
    project: str
    image: str
    network: str
    net_prefix: str
    shared: str
    wheels: str | None = None
    #: The Python of the flavor's Debian release, whose wheels the wheelhouse holds.
    python: str = "3.13"
    #: cgroup.conf of the nodes, relative to docker/
    cgroup_conf: str = "cgroup.conf"

    @property
    def base_image(self) -> str:
        return f"debian:{self.suite}"

    @property
    def system_image(self) -> str:
        return f"torchpass-slurm-system:{self.name}"

    @property
    def system_dockerfile(self) -> Path:
        return DOCKER_DIR / self.name / "Dockerfile.system"

    @property
    def wheelhouse(self) -> Path:
        return ROOT / ".cluster" / "wheels" / self.name


FLAVORS = {
    "trixie": Flavor(
        "trixie",
        "trixie",
        "torchpass",
        "torchpass-slurm-node:dev",
        "torchpass-net",
        "172.29.77",
        "shared",
        wheels="trixie/wheels.txt",
    ),
    "bookworm": Flavor(
        "bookworm",
        "bookworm",
        "torchpass-bw",
        "torchpass-slurm-node:bookworm",
        "torchpass-bw-net",
        "172.29.78",
        "shared-bookworm",
        wheels="bookworm/wheels.txt",
        python="3.11",
        cgroup_conf="bookworm/cgroup.conf",
    ),
}
_flavor_name = os.environ.get("TP_CLUSTER_FLAVOR", "trixie")
if _flavor_name not in FLAVORS:
    sys.exit(f"TP_CLUSTER_FLAVOR={_flavor_name!r} is not a cluster flavor; valid: {', '.join(FLAVORS)}")
FLAVOR = FLAVORS[_flavor_name]
PROJECT = os.environ.get("TP_CLUSTER_PROJECT", FLAVOR.project)
BASE_IMAGE = FLAVOR.base_image

IMAGE = os.environ.get("TP_CLUSTER_IMAGE", FLAVOR.image)
NETWORK = os.environ.get("TP_CLUSTER_NETWORK", FLAVOR.network)
NET_PREFIX = os.environ.get("TP_CLUSTER_NET_PREFIX", FLAVOR.net_prefix)
SHARED = Path(os.environ.get("TP_CLUSTER_SHARED", ROOT / ".cluster" / FLAVOR.shared)).resolve()
MIRROR = os.environ.get("TP_CLUSTER_BASE_MIRROR", "http://deb.debian.org/debian")
#: The host's pip, which fills a flavor's wheelhouse (PIP, else the project's .venv, else python3's).
PIP = os.environ.get("TP_CLUSTER_PIP", "")

#: How long `up` waits for every compute node to be idle (seconds).
UP_TIMEOUT_S = 240.0
#: How long the nodes may take to come back idle after a test or a benchmark run (seconds).
HEALTHY_TIMEOUT_S = 180.0
#: How long one docker command may take before we give up (seconds).
DOCKER_TIMEOUT_S = 300.0
#: How long one command on a node may take, unless the caller says otherwise (seconds).
EXEC_TIMEOUT_S = 120.0
#: How long one image build may take (seconds).
BUILD_TIMEOUT_S = 1800.0
#: Seconds between two looks at the nodes while waiting for them.
POLL_S = 1.0
#: How long a node may look ALLOCATED with no job before ensure_healthy repairs it.
STUCK_AFTER_S = 10.0
#: Log lines quoted from a node that did not come up.
EXCERPT_LINES = 6
#: Slurm states from which `wait_idle(resume=True)` resumes a node (scontrol state=resume).
RESUMABLE = ("down", "drain", "fail")
#: Job states of a job that has not finished yet.
UNFINISHED = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING")

T = TypeVar("T")


class ClusterError(Exception):
    """The cluster or a command on it did not do what was asked; the message says what was seen."""


def log(msg: str) -> None:
    print(f"[cluster {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def container(node: str) -> str:
    if node not in NODES:
        raise ClusterError(f"unknown node {node!r}; the nodes are {', '.join(NODES)}")
    return f"{PROJECT}-{node}"


def node_ip(node: str) -> str:
    return f"{NET_PREFIX}.{10 + NODES.index(node)}"


def command(
    argv: Sequence[str],
    *,
    timeout: float = DOCKER_TIMEOUT_S,
    check: bool = True,
    capture: bool = True,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run one host command (docker, compose, debootstrap); ClusterError when it fails."""
    try:
        proc = subprocess.run(
            list(argv),
            capture_output=capture,
            text=True,
            timeout=timeout,
            check=False,
            env=None if env is None else dict(env),
        )
    except FileNotFoundError:
        raise ClusterError(
            f"`{argv[0]}` is not installed; the dev cluster needs Docker "
            "(scripts/host-setup installs it, docs/dev-cluster.md)"
        ) from None
    except subprocess.TimeoutExpired:
        raise ClusterError(f"`{' '.join(argv)}` did not finish within {timeout:g} s") from None
    if check and proc.returncode != 0:
        said = (proc.stderr or proc.stdout or "").strip()[-2000:] if capture else ""
        raise ClusterError(
            f"`{' '.join(argv)}` failed with status {proc.returncode}" + (f": {said}" if said else "")
        )
    return proc


# --- images ----------------------------------------------------------------------


def require_docker() -> None:
    if shutil.which("docker") is None:
        raise ClusterError("docker is not installed; scripts/host-setup says what to install")
    proc = command(["docker", "info", "--format", "{{.ServerVersion}}"], check=False, timeout=30)
    if proc.returncode != 0:
        raise ClusterError(
            "the Docker engine does not answer; start dockerd, or run "
            f"scripts/host-setup as root (docker said: {proc.stderr.strip()})"
        )


def compose_cmd() -> list[str]:
    """docker-compose v1 where installed, else the `docker compose` v2 plugin."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if command(["docker", "compose", "version"], check=False, timeout=30).returncode == 0:
        return ["docker", "compose"]
    raise ClusterError("neither docker-compose nor the `docker compose` plugin is installed")


def compose(*args: str, timeout: float = DOCKER_TIMEOUT_S) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        TP_CLUSTER_IMAGE=IMAGE,
        TP_CLUSTER_NETWORK=NETWORK,
        TP_CLUSTER_NET_PREFIX=NET_PREFIX,
        TP_CLUSTER_SHARED=str(SHARED),
        TP_CLUSTER_PROJECT=PROJECT,
        TP_CLUSTER_CGROUP_CONF=f"./{FLAVOR.cgroup_conf}",
    )
    argv = [*compose_cmd(), "-p", PROJECT, "-f", str(COMPOSE_FILE), *args]
    return command(argv, timeout=timeout, env=env)


def image_exists(name: str) -> bool:
    return command(["docker", "image", "inspect", name], check=False, timeout=60).returncode == 0


def ensure_base_image() -> None:
    """debian:<suite>: present, else pulled, else built with debootstrap (air-gapped)."""
    if image_exists(BASE_IMAGE):
        return
    log(f"{BASE_IMAGE} not present; trying docker pull")
    if command(["docker", "pull", BASE_IMAGE], check=False, timeout=600).returncode == 0:
        return
    if shutil.which("debootstrap") is None:
        raise ClusterError(
            f"{BASE_IMAGE} can be neither found nor pulled, and debootstrap is "
            "not installed to build it (apt-get install debootstrap)"
        )
    log(f"building {BASE_IMAGE} with debootstrap from {MIRROR} (about a minute)")
    with tempfile.TemporaryDirectory(prefix=f"tp-{FLAVOR.suite}-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        command(["debootstrap", "--variant=minbase", FLAVOR.suite, str(rootfs), MIRROR], timeout=1200)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        try:
            imp = subprocess.run(
                ["docker", "import", "-", BASE_IMAGE],
                stdin=tar.stdout,
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
        finally:
            assert tar.stdout is not None
            tar.stdout.close()
            tar.wait(timeout=600)
        if imp.returncode != 0 or tar.returncode != 0:
            raise ClusterError(f"docker import of the debootstrap tree failed: {imp.stderr.strip()}")
    log(f"{BASE_IMAGE} built")


def pip_command() -> list[str]:
    if PIP:
        return [PIP]
    venv_pip = ROOT / ".venv" / "bin" / "pip"
    return [str(venv_pip)] if venv_pip.exists() else [sys.executable, "-m", "pip"]


def ensure_wheelhouse() -> Path | None:
    """The flavor's wheels, downloaded by the host's pip (containers here cannot reach PyPI):
    CPython manylinux x86_64 wheels (the flavor's Python) of FLAVOR.wheels, kept in
    .cluster/wheels/<flavor>."""
    if FLAVOR.wheels is None:
        return None
    requirements = DOCKER_DIR / FLAVOR.wheels
    house = FLAVOR.wheelhouse
    house.mkdir(parents=True, exist_ok=True)
    stamp = house / "wheels.txt"
    if stamp.exists() and stamp.read_text() == requirements.read_text():
        return house
    log(
        f"downloading the wheels of {requirements.relative_to(ROOT)} into {house} "
        "(up to 230 MB the first time)"
    )
    platforms = [
        "manylinux_2_28_x86_64",
        "manylinux_2_17_x86_64",
        "manylinux2014_x86_64",
        "manylinux_2_5_x86_64",
        "manylinux1_x86_64",
        "linux_x86_64",
    ]
    binary, source = [], []
    for line in requirements.read_text().splitlines():
        req = line.split("#", 1)[0].strip()
        if req:
            (source if line.rstrip().endswith("# pure Python, sdist only") else binary).append(req)
    command(
        [
            *pip_command(),
            "download",
            "-q",
            "--only-binary=:all:",
            "--python-version",
            FLAVOR.python,
            "--implementation",
            "cp",
            *(f"--platform={p}" for p in platforms),
            "-d",
            str(house),
            *binary,
        ],
        timeout=BUILD_TIMEOUT_S,
    )
    if source:  # built here into a py3-none-any wheel, which any Python 3 installs
        command(
            [*pip_command(), "wheel", "-q", "--no-deps", "-w", str(house), *source], timeout=BUILD_TIMEOUT_S
        )
    shutil.copyfile(requirements, stamp)
    return house


def build_system_image() -> None:
    """The flavor's system layer (Slurm, Python, torch, MPI), from its own small context:
    the wheelhouse, or nothing. Docker's cache makes an unchanged one a matter of seconds."""
    house = ensure_wheelhouse()
    with tempfile.TemporaryDirectory(prefix="tp-context-") as empty:
        context = str(house) if house is not None else empty
        proc = command(
            [
                "docker",
                "build",
                "-q",
                "-f",
                str(FLAVOR.system_dockerfile),
                "-t",
                FLAVOR.system_image,
                context,
            ],
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise ClusterError(f"building {FLAVOR.system_image} failed (output above)")


def build() -> None:
    """The node image: the base image first when missing, the system layer, then the project."""
    require_docker()
    ensure_base_image()
    log(f"building {IMAGE} (the first build takes a few minutes; later ones seconds)")
    started = time.monotonic()
    build_system_image()
    proc = command(
        [
            "docker",
            "build",
            "-q",
            "-f",
            str(DOCKER_DIR / "Dockerfile"),
            "--build-arg",
            f"SYSTEM_IMAGE={FLAVOR.system_image}",
            "-t",
            IMAGE,
            str(ROOT),
        ],
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise ClusterError(f"building {IMAGE} failed (output above)")
    log(f"{IMAGE} ready in {time.monotonic() - started:.0f} s")


# --- what a poll sees, judged (pure) -------------------------------------------------


def parse_node_states(sinfo: str) -> dict[str, str]:
    """``sinfo -h -N -o "%N %T"`` output -> node -> state in lower case (idle, down*, ...)."""
    states: dict[str, str] = {}
    for line in sinfo.splitlines():
        parts = line.split()
        if len(parts) == 2:
            states[parts[0]] = parts[1].lower()
    return states


def stopped_nodes(nodes: Sequence[str], containers: Mapping[str, str]) -> list[str]:
    """The nodes whose container is not running (exited, dead, absent): they will never be idle."""
    return [n for n in nodes if containers.get(n, "absent") != "running"]


def log_excerpt(text: str, lines: int = EXCERPT_LINES) -> list[str]:
    """What a daemon's log says about why it stopped: its last error or fatal lines,
    else its last lines."""
    tail = [line.rstrip() for line in text.splitlines() if line.strip()]
    errors = [line for line in tail if re.search(r"\b(error|fatal)\b", line, re.IGNORECASE)]
    return (errors or tail)[-lines:]


def not_up_message(
    waiting: Mapping[str, str], stopped: Sequence[str], logs: Mapping[str, str], waited_s: float
) -> str:
    """Why the cluster is not up: which nodes, in which state, and what their logs say."""
    if stopped:
        head = f"{', '.join(stopped)} stopped {waited_s:.0f} s after the start (container not running)"
    else:
        summary = ", ".join(f"{n}={s}" for n, s in sorted(waiting.items()))
        head = f"nodes not idle after {waited_s:.0f} s: {summary}"
    parts = [head]
    saying: dict[tuple[str, ...], list[str]] = {}  # nodes that say the same, quoted once
    for node in sorted(logs):
        saying.setdefault(tuple(log_excerpt(logs[node])), []).append(node)
    for excerpt, nodes in saying.items():
        said = "\n".join(f"    {line}" for line in excerpt) if excerpt else "    (empty log)"
        parts.append(f"  {', '.join(nodes)} {'says' if len(nodes) == 1 else 'say'}:\n{said}")
    parts.append(
        "More: `scripts/cluster logs NODE`, `scripts/cluster status`; "
        "`scripts/cluster down` removes the cluster (docs/dev-cluster.md, Troubleshooting)"
    )
    return "\n".join(parts)


def wait_for(probe: Callable[[], T | None], *, timeout: float, what: str, interval: float = 1.0) -> T:
    """Poll ``probe`` until it returns a truthy value; ClusterError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise ClusterError(f"timed out after {timeout:g} s waiting for {what} (last: {last!r})")


# --- the cluster -----------------------------------------------------------------------


@dataclass
class Cluster:
    """The dev cluster as seen from the host: ctl (slurmctld, the login node), c1..c5
    (partition ``debug``) and the service node s1 (partition ``service``)."""

    shared_host: Path = SHARED
    shared_node: str = "/shared"

    # -- lifecycle ---------------------------------------------------------
    def up(self, *, build_image: bool = True, timeout: float = UP_TIMEOUT_S) -> None:
        """Build (unless told not to), start, and wait until every compute node is idle."""
        require_docker()
        if build_image:
            build()
        elif not image_exists(IMAGE):
            raise ClusterError(f"image {IMAGE} does not exist; run without --no-build")
        self.shared_host.mkdir(parents=True, exist_ok=True)
        os.chmod(self.shared_host, 0o1777)
        log(f"starting {', '.join(NODES)}")
        started = time.monotonic()
        compose("up", "-d", "--no-build")
        self.wait_idle(timeout=timeout)
        log(
            f"cluster up in {time.monotonic() - started:.0f} s: {len(NODES)} containers, "
            f"{len(COMPUTE)} idle nodes and the service node {', '.join(SERVICE)} "
            "(`scripts/cluster status`)"
        )

    def down(self) -> None:
        require_docker()
        log("removing the cluster's containers and network")
        compose("down", "--remove-orphans", "--timeout", "5")
        leftover = self.containers()
        if leftover:
            command(["docker", "rm", "-f", *(container(n) for n in leftover)], check=False)
        log("cluster down")

    def is_up(self) -> bool:
        """The controller answers ``sinfo`` (the cluster runs, whoever started it)."""
        proc = command(
            ["docker", "exec", container(CONTROLLER), "sinfo", "-h", "-o", "%N"], check=False, timeout=60
        )
        return proc.returncode == 0

    def containers(self) -> dict[str, str]:
        """Node -> docker state (running, exited, ...) of the cluster's containers that exist."""
        proc = command(
            ["docker", "ps", "-a", "--filter", f"name=^{PROJECT}-", "--format", "{{.Names}}\t{{.State}}"],
            timeout=30,
        )
        out = {}
        for line in proc.stdout.splitlines():
            name, _, state = line.partition("\t")
            node = name[len(PROJECT) + 1 :]
            if node in NODES:
                out[node] = state
        return out

    # -- running things ----------------------------------------------------
    def exec(
        self,
        node: str,
        *cmd: str,
        timeout: float = EXEC_TIMEOUT_S,
        check: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess:
        """Run a command on a node; ``check``: ClusterError with its output when it fails."""
        env_args = [a for k, v in (env or {}).items() for a in ("-e", f"{k}={v}")]
        proc = command(["docker", "exec", *env_args, container(node), *cmd], timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise ClusterError(
                f"on {node}: {' '.join(cmd)} failed ({proc.returncode}):\n"
                f"stdout: {proc.stdout}\nstderr: {proc.stderr}"
            )
        return proc

    def interactive(self, node: str, cmd: Sequence[str]) -> int:
        """A command on a node with the terminal attached; its exit status."""
        tty = ["-t"] if sys.stdin.isatty() and sys.stdout.isatty() else []
        return subprocess.call(["docker", "exec", "-i", *tty, container(node), *cmd])

    def daemon_log(self, node: str, lines: int = 200) -> str:
        """The last lines of the node's Slurm daemon log: its log file while the container
        runs, else what the daemon wrote to the container's output (`docker logs`)."""
        path = "/var/log/slurm/slurmctld.log" if node == CONTROLLER else "/var/log/slurm/slurmd.log"
        proc = self.exec(node, "tail", "-n", str(lines), path, check=False, timeout=30)
        if proc.returncode == 0:
            return proc.stdout
        proc = command(["docker", "logs", "--tail", str(lines), container(node)], check=False, timeout=30)
        return proc.stdout + proc.stderr

    # -- Slurm's view ------------------------------------------------------
    def node_states(self) -> dict[str, str]:
        """Node -> long state as `sinfo -N -o %T` prints it, e.g. idle, down*, idle*."""
        return parse_node_states(self.exec(CONTROLLER, "sinfo", "-h", "-N", "-o", "%N %T").stdout)

    def node_json(self, node: str) -> dict:
        out = self.exec(CONTROLLER, "scontrol", "--json", "show", "node", node).stdout
        return json.loads(out)["nodes"][0]

    def job_field(self, job_id: str, field: str) -> str:
        out = self.exec(CONTROLLER, "scontrol", "-o", "show", "job", job_id).stdout
        m = re.search(rf"(?:^|\s){field}=(\S*)", out)
        if not m:
            raise ClusterError(f"no {field}= in `scontrol show job {job_id}`: {out}")
        return m.group(1)

    def job_nodes(self, job_id: str) -> list[str]:
        """The nodes the job holds now (Slurm updates this when the job loses or sheds one)."""
        return self.hostnames(self.job_field(job_id, "NodeList"))

    def hostnames(self, hostlist: str) -> list[str]:
        return self.exec(CONTROLLER, "scontrol", "show", "hostnames", hostlist).stdout.split()

    def sbatch(self, *args: str) -> str:
        out = self.exec(CONTROLLER, "sbatch", "--parsable", *args).stdout.strip()
        return out.split(";")[0]

    def wait_job_done(self, job_id: str, timeout: float = 180) -> str:
        """The job's final state, once it has one."""

        def finished() -> str | None:
            state = self.job_field(job_id, "JobState")
            return state if state not in UNFINISHED else None

        return wait_for(finished, timeout=timeout, what=f"job {job_id} to finish")

    # -- tp's view ---------------------------------------------------------
    def tp_submit(self, run_dir: str, *args: str, env: Mapping[str, str] | None = None) -> str:
        """``tp-submit ARGS`` on ctl with its run folder (under /shared) and output there; the job id."""
        return self.exec(
            CONTROLLER,
            "tp-submit",
            "--parsable",
            "--run-dir",
            run_dir,
            "--output",
            f"{run_dir}/slurm-%j.out",
            *args,
            env=env,
        ).stdout.strip()

    def tp_status(self, job_id: str) -> dict[str, Any]:
        return json.loads(self.exec(CONTROLLER, "tp", "status", job_id, "--json").stdout)

    def tp_step(self, job_id: str) -> int:
        """The lowest committed step over the job's active nodes; 0 before the first, or
        while tp cannot tell yet."""
        proc = self.exec(CONTROLLER, "tp", "status", job_id, "--json", check=False)
        try:
            nodes = json.loads(proc.stdout).get("nodes", [])
            steps = [n.get("last_step") or 0 for n in nodes if n.get("role") == "active"]
        except (ValueError, AttributeError):
            return 0
        return min(steps) if steps else 0

    def tp_victim(self, job_id: str) -> str:
        """An active node of a tp job that is not its batch host (the supervisor lives there)."""
        batch_host = self.job_field(job_id, "BatchHost")
        for node in self.tp_status(job_id).get("nodes", []):
            if node.get("role") == "active" and node.get("node") != batch_host:
                return str(node["node"])
        raise ClusterError(f"job {job_id} has no active node besides its batch host {batch_host}")

    # -- faults ------------------------------------------------------------
    def kill(self, node: str) -> None:
        """Power loss: the node's container is killed (SIGKILL to everything, no shutdown)."""
        command(["docker", "kill", container(node)])
        log(f"{node}: power cut (container killed)")

    def restart(self, node: str) -> None:
        """Power the node back on, or restart it when it runs."""
        name = container(node)
        if self.containers().get(node) == "running":
            command(["docker", "restart", "--time", "5", name])
        else:
            command(["docker", "start", name])
        log(f"{node}: powered on")

    def attached(self, node: str) -> bool:
        proc = command(
            ["docker", "inspect", "--format", "{{json .NetworkSettings.Networks}}", container(node)],
            timeout=30,
        )
        return NETWORK in json.loads(proc.stdout or "{}")

    def partition(self, node: str) -> None:
        """Cut the node off the cluster network: it runs on, silent."""
        if not self.attached(node):
            raise ClusterError(f"{node} is already cut off the network ({NETWORK})")
        command(["docker", "network", "disconnect", NETWORK, container(node)])
        log(f"{node}: cut off the network {NETWORK}")

    def heal(self, node: str) -> None:
        """Plug the node back in, at its old address, and have its slurmd register again.

        Slurm may have set the node DOWN while it was cut off (SlurmdTimeout), and then
        waits minutes before it asks a DOWN node to register (measured: still ``down*``
        84 s after the heal); a SIGHUP makes slurmd re-read its configuration and
        register at once, as it does when it starts, without touching running steps.
        """
        if self.attached(node):
            raise ClusterError(f"{node} is already on the network ({NETWORK})")
        command(["docker", "network", "connect", "--ip", node_ip(node), NETWORK, container(node)])
        self.exec(node, "pkill", "-HUP", "-x", "slurmd", check=False)
        log(f"{node}: back on the network at {node_ip(node)}")

    # -- repair ------------------------------------------------------------
    def wait_idle(self, *, timeout: float = UP_TIMEOUT_S, resume: bool = False) -> None:
        """Every compute node idle; ``resume``: resume the down, drained or failed ones.

        A node whose container stopped never becomes idle: that fails at once, with the
        last error lines of its log, as does the timeout (with the logs of the nodes
        still not idle)."""
        started = time.monotonic()
        last = ""
        reconfigured = False
        while True:
            containers = self.containers()
            slurm_nodes = COMPUTE + self.service_nodes(containers)
            stopped = stopped_nodes((CONTROLLER, *slurm_nodes), containers)
            states = {} if CONTROLLER in stopped else self._states_or_none()
            waiting = {n: states.get(n, "unknown") for n in slurm_nodes if states.get(n) != "idle"}
            if not waiting and not stopped:
                return
            waited = time.monotonic() - started
            if stopped or waited > timeout:
                blamed = stopped or [CONTROLLER, *waiting]
                logs = {n: self.daemon_log(n, lines=50) for n in blamed}
                raise ClusterError(not_up_message(waiting, stopped, logs, waited))
            summary = ", ".join(f"{n}={s}" for n, s in sorted(waiting.items()))
            if summary != last:
                log(f"waiting for idle: {summary}")
                last = summary
            if resume:
                for node, state in waiting.items():
                    if state.startswith(RESUMABLE):
                        self.exec(
                            CONTROLLER, "scontrol", "update", f"nodename={node}", "state=resume", check=False
                        )
                if waited > STUCK_AFTER_S and not reconfigured and self._stuck(waiting):
                    reconfigured = True
            time.sleep(POLL_S)

    def _stuck(self, waiting: Mapping[str, str]) -> bool:
        """Slurm 24.11 keeps a node ALLOCATED with no job on it once it left a job as it was set
        DOWN (docs/admin-guide.md, "Spare pool refills"); ``scontrol reconfigure`` clears it.
        Said aloud, and done once per wait: whether it was."""
        stuck = [
            n
            for n, state in waiting.items()
            if state == "allocated"
            and not self.exec(CONTROLLER, "squeue", "-h", "-w", n, check=False).stdout.strip()
        ]
        if stuck:
            log(f"Slurm holds {', '.join(stuck)} ALLOCATED with no job on it: scontrol reconfigure")
            self.exec(CONTROLLER, "scontrol", "reconfigure", check=False)
        return bool(stuck)

    @staticmethod
    def service_nodes(containers: Mapping[str, str]) -> tuple[str, ...]:
        """The service nodes this cluster has: those whose container exists (a cluster
        brought up from a compose file older than the service partition has none)."""
        return tuple(n for n in SERVICE if n in containers)

    def _states_or_none(self) -> dict[str, str]:
        proc = self.exec(CONTROLLER, "sinfo", "-h", "-N", "-o", "%N %T", check=False, timeout=30)
        return parse_node_states(proc.stdout) if proc.returncode == 0 else {}

    def ensure_healthy(self, timeout: float = HEALTHY_TIMEOUT_S) -> None:
        """Bring every compute node back to idle: no jobs left, nodes powered on, plugged
        back in, resumed."""
        self.exec(CONTROLLER, "scancel", "--full", "--user=root", check=False)
        containers = self.containers()
        for node in COMPUTE + self.service_nodes(containers):
            if containers.get(node) != "running":
                self.restart(node)
            elif not self.attached(node):
                self.heal(node)
        self.wait_idle(timeout=timeout, resume=True)

    # -- the shared folder -------------------------------------------------
    def host_path(self, node_path: str) -> Path:
        """The host side of a path under the nodes' /shared."""
        prefix = self.shared_node.rstrip("/") + "/"
        if not node_path.startswith(prefix):
            raise ValueError(f"{node_path!r} is not under {prefix}")
        return self.shared_host / node_path[len(prefix) :]

    def read_shared(self, relpath: str) -> str:
        return (self.shared_host / relpath).read_text()
