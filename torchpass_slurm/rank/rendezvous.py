"""Where an epoch's process group meets: the job's store, or ``env://``.

Under ``tp run`` every epoch's group meets in the job's store (hosted beside
the supervisor, ``TORCHPASS_STORE``) under the prefix ``epoch<N>``, so a
later epoch can be built by the same processes; every rank first counts in
and waits for the others (:meth:`EpochRendezvous.join`), with a timeout of
its own. The store is reached with the job's secret
(:class:`~torchpass_slurm.rank.store.JobStore`): nobody without it can read
or write a key. A rank given a store but no secret (the unit tests' loopback
ranks, which host torch's own store) reaches it as a plain ``TCPStore``.
Elsewhere the group meets at ``MASTER_ADDR:MASTER_PORT``. torch is imported
only when a group is built.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable
from typing import Any

from torchpass_slurm.errors import ConfigError, RendezvousTimeout
from torchpass_slurm.rank.backends import GroupBackend, group_backend
from torchpass_slurm.rank.rankinfo import RankInfo

__all__ = ["EpochRendezvous", "make_tcp_store"]

#: How often a rank that counted in polls the store for the others (seconds).
POLL_S = 0.05


class EpochRendezvous:
    """One rank's way into each epoch's group; the store connection is reused by every epoch."""

    def __init__(
        self, log: logging.LoggerAdapter[logging.Logger], secret: Callable[[], bytes | None] = lambda: None
    ) -> None:
        self.log = log
        self._secret = secret
        self._stores: dict[tuple[str, int], Any] = {}

    def join(
        self,
        info: RankInfo,
        backend: str | GroupBackend,
        timeout: datetime.timedelta,
        rendezvous_timeout: datetime.timedelta | None = None,
    ) -> None:
        """Build ``info``'s group through ``backend`` (``rank/backends.py``): ``timeout`` bounds
        every collective, ``rendezvous_timeout`` (default: the same) how long to wait for every
        rank to arrive."""
        import torch.distributed as dist

        seam = group_backend(backend)
        if info.store_addr and info.store_port:
            wait = rendezvous_timeout or timeout
            client = self.store(str(info.store_addr), int(info.store_port), max(wait, timeout))
            store = dist.PrefixStore(f"epoch{info.epoch}", client)
            _await_all_ranks(store, info, wait)
            recorded = seam.create(info, timeout, self.log, store=store)
            self.log.info(
                "process group up: backend=%s store=%s:%s epoch %d, %d sockets recorded",
                seam.name,
                info.store_addr,
                info.store_port,
                info.epoch,
                recorded,
            )
            return
        if info.world_size > 1 and (not info.master_addr or info.master_port is None):
            raise ConfigError(
                f"MASTER_ADDR/MASTER_PORT are not set for a world of {info.world_size} ranks",
                hint="export them (the sbatch examples show how)",
            )
        recorded = seam.create(info, timeout, self.log)
        self.log.info(
            "process group up: backend=%s master=%s:%s, %d sockets recorded",
            seam.name,
            info.master_addr,
            info.master_port,
            recorded,
        )

    def store(self, addr: str, port: int, timeout: datetime.timedelta) -> Any:
        """The connection to the job's store at ``addr:port`` (made once, then reused by every
        epoch; ``timeout`` bounds its waits): authenticated with the job's secret when the rank
        has one."""
        client = self._stores.get((addr, port))
        if client is None:
            secret = self._secret()
            if secret is not None:
                from torchpass_slurm.rank.store import JobStore

                client = JobStore(addr, port, secret, timeout)
            else:
                client = make_tcp_store(addr, port, is_master=False, timeout=timeout)
            self._stores[(addr, port)] = client
        else:
            client.set_timeout(timeout)
        return client


def _await_all_ranks(store: Any, info: RankInfo, wait: datetime.timedelta) -> None:
    """Count in at the epoch's store and wait (polling) until every rank has.

    Kept apart from the group's own rendezvous, whose timeout is also the
    collective timeout: a rank that is still stuck in the old epoch's
    collective may take that long to arrive.
    """
    store.add("torchpass/joined", 1)
    deadline = time.monotonic() + wait.total_seconds()
    while (joined := store.add("torchpass/joined", 0)) < info.world_size:
        if time.monotonic() > deadline:
            raise RendezvousTimeout(
                f"rendezvous of epoch {info.epoch} timed out after {wait}: "
                f"{joined} of {info.world_size} ranks arrived"
            )
        time.sleep(POLL_S)


def make_tcp_store(host: str, port: int, *, is_master: bool, timeout: datetime.timedelta) -> Any:
    """A torch TCPStore without libuv (Debian's torch is built without it)."""
    import torch.distributed as dist

    kwargs: dict[str, Any] = {"is_master": is_master, "timeout": timeout}
    if is_master:
        kwargs["wait_for_workers"] = False
    try:
        return dist.TCPStore(host, port, use_libuv=False, **kwargs)
    except TypeError:  # a torch that predates use_libuv
        return dist.TCPStore(host, port, **kwargs)
