"""Is a silent node still there? A TCP probe of its slurmd, off the loop's thread.

Silence alone does not tell a dead node from a rank that is busy or a host
that is loaded, so the detectors only blame a node that went silent once a
second, independent signal agrees (:mod:`.detect`). This is one of them:
the node's slurmd port (``SlurmdPort``, 6818 by default) either accepts a TCP
connection within ``timeout`` (the machine and its network are up, whatever
its ranks do) or it does not (powered off, cut off the network). A refused
connection counts as reachable: a kernel answered.

It also resolves the job's node names once, so that a peer's report naming an
address (``Connection closed by peer [10.1.2.3]:5000``) can be mapped to a node.

Probes run in a small thread pool; :meth:`NodeProbe.verdict` never blocks.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Probe", "NodeProbe", "ProbeResult", "DEFAULT_SLURMD_PORT"]

logger = logging.getLogger(__name__)

DEFAULT_SLURMD_PORT = 6818
#: Probes of different nodes that may run at once.
MAX_PARALLEL = 8


@dataclass(frozen=True)
class ProbeResult:
    """One finished probe: when it started (wall clock), and what it found.

    ``reachable`` False is evidence that the node is gone; True is none (it
    answered, or the probe could not tell).
    """

    started: float
    reachable: bool
    detail: str
    #: the slurmd accepted the connection: the node is up and Slurm's daemon on it runs
    slurmd: bool = False


class Probe(Protocol):
    """What the detectors need from a prober (the tests give a fake)."""

    def start(self, node: str) -> None: ...

    def verdict(self, node: str, since: float) -> ProbeResult | None: ...

    def node_of_address(self, address: str) -> str | None: ...

    def probe_now(self, node: str) -> ProbeResult: ...

    def close(self) -> None: ...


class NodeProbe:
    """Probes nodes' slurmd ports in the background; see the module docstring."""

    def __init__(
        self, nodes: Iterable[str], *, port: int = DEFAULT_SLURMD_PORT, timeout: float = 0.5
    ) -> None:
        self.port = port
        self.timeout = timeout
        self._pool = ThreadPoolExecutor(max_workers=MAX_PARALLEL, thread_name_prefix="tp-probe")
        self._pending: dict[str, Future[ProbeResult]] = {}
        self._done: dict[str, ProbeResult] = {}
        self._addresses: dict[str, str] = {}
        self._resolving = self._pool.submit(self._resolve_all, tuple(nodes))

    def start(self, node: str) -> None:
        """Probe ``node`` unless a probe of it is already running."""
        if node not in self._pending:
            self._pending[node] = self._pool.submit(self._probe, node)

    def verdict(self, node: str, since: float) -> ProbeResult | None:
        """The newest finished probe of ``node`` that started at or after ``since``, or None."""
        future = self._pending.get(node)
        if future is not None and future.done():
            del self._pending[node]
            self._done[node] = future.result()
        result = self._done.get(node)
        return result if result is not None and result.started >= since else None

    def node_of_address(self, address: str) -> str | None:
        """The job's node with this IP address (or name), once the names are resolved."""
        if not self._resolving.done():
            return None
        return self._addresses.get(address)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _resolve_all(self, nodes: tuple[str, ...]) -> None:
        for node in nodes:
            self._addresses[node] = node
            try:
                for info in socket.getaddrinfo(node, None, type=socket.SOCK_STREAM):
                    self._addresses[str(info[4][0])] = node
            except OSError as err:  # a name that does not resolve cannot be named by a peer either
                logger.debug("cannot resolve %s: %s", node, err)

    def probe_now(self, node: str) -> ProbeResult:
        """Probe ``node`` on the calling thread (at most ``timeout`` s)."""
        return self._probe(node)

    def _probe(self, node: str) -> ProbeResult:
        started = time.time()
        try:
            with socket.create_connection((node, self.port), timeout=self.timeout):
                return ProbeResult(started, True, f"{node}:{self.port} accepts connections", slurmd=True)
        except ConnectionRefusedError:
            return ProbeResult(started, True, f"{node}:{self.port} refused (the host answers)")
        except socket.gaierror as err:  # a resolver's trouble is no evidence against the node
            return ProbeResult(started, True, f"cannot resolve {node} ({err}): no verdict")
        except TimeoutError:
            return ProbeResult(started, False, f"{node}:{self.port} did not answer within {self.timeout:g} s")
        except OSError as err:  # unreachable host or network, no route, no such name
            return ProbeResult(started, False, f"{node}:{self.port} unreachable ({err.strerror or err})")
