"""The in-rank runtime: what a training process calls to join a torchpass job.

At the top of the training script (with the elastic loop of
:mod:`torchpass_slurm.rank.elastic`, which calls the rest)::

    from torchpass_slurm.rank import runtime
    rt = runtime.Runtime.from_env()      # connect; never blocks
    model, optimizer = build()           # a hot spare builds before it waits
    rt.start()                           # a spare blocks here until promoted
    ElasticTrainer(rt, model, optimizer, state=...).fit(train_step, steps)
    rt.close()

or, without it, ``rt = runtime.init()``, ``rt.init_process_group("gloo")``,
``rt.report_step(step)`` each step and ``rt.close()``.

It reads the environment contract (``docs/design/runtime-contract.md``) and
runs in one of three modes::

    mode     when                          rank from                               control plane
    plain    no TORCHPASS_CONTROL          RANK | SLURM_PROCID  (torchrun / srun)   none
    active   TORCHPASS_ROLE=active         TORCHPASS_RANK_BASE + SLURM_LOCALID      hello, heartbeats, bye
    spare    TORCHPASS_ROLE=spare          the promote message                      standby ... promote | stop

      spare ──standby──► waits (heartbeats "standby") ──promote──► active (hello, heartbeats)
                                    └──────────stop──────────► exit 0

In every mode ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` are put in ``os.environ`` so that
``torch.distributed``'s ``env://`` rendezvous finds them; the same script runs
under plain ``srun``, ``torchrun`` and ``tp run``.

The control-plane socket is used by one thread at a time: the main thread until
the heartbeat thread starts, then only that thread. The training thread talks
to it through plain attributes (the step, the state) and an event (close).

This module imports neither torch nor zmq at import time.
"""

from __future__ import annotations

import datetime
import logging
import os
import queue
import threading
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

from torchpass_slurm.config import (
    ENV_CONTROL,
    ENV_JOB_ID,
    ENV_NODE,
    ENV_SECRET_FILE,
    SupervisorConfig,
)
from torchpass_slurm.control import rank_bodies
from torchpass_slurm.control.bodies import Promote, Reconfigure
from torchpass_slurm.control.kinds import Kind, ReportKind
from torchpass_slurm.control.messages import body_of
from torchpass_slurm.control.reports import Report
from torchpass_slurm.control.schema import JSONObject
from torchpass_slurm.errors import ControlPlaneError
from torchpass_slurm.phase import Phase
from torchpass_slurm.rank.backends import GroupBackend, RebuildRequest, group_backend
from torchpass_slurm.rank.group import superseding
from torchpass_slurm.rank.health_agent import HealthAgent
from torchpass_slurm.rank.link import (
    ClientFactory,
    ControlClientLike,
    Heartbeat,
    JobSeals,
    Message,
    Outbox,
    connect_control,
    wait_for_promotion,
)
from torchpass_slurm.rank.nodebeat import node_beat
from torchpass_slurm.rank.orphan import Orphan
from torchpass_slurm.rank.rankinfo import (
    RankInfo,
    Role,
    _int,
    _require,
    active_rank_info,
    plain_rank_info,
    promoted_rank_info,
    role_from_env,
)
from torchpass_slurm.rank.rendezvous import EpochRendezvous, make_tcp_store
from torchpass_slurm.transfer.seal import Seal

__all__ = ["init", "Runtime", "Role", "RankInfo", "ControlClientLike", "DEFAULT_PG_TIMEOUT", "make_tcp_store"]

logger = logging.getLogger(__name__)

#: Default timeout of collectives in the process group made by
#: :meth:`Runtime.init_process_group` (bounds how long a silent peer blocks).
DEFAULT_PG_TIMEOUT = datetime.timedelta(minutes=5)
#: What a message this rank cannot read suggests.
SKEW_HINT = "the supervisor and this worker run different torchpass-slurm versions?"
#: How long :meth:`Runtime.close` waits for the heartbeat thread to say bye.
CLOSE_TIMEOUT = datetime.timedelta(seconds=10)


# --- the runtime ------------------------------------------------------------------


if TYPE_CHECKING:
    _LoggerAdapter = logging.LoggerAdapter[logging.Logger]
else:  # subscriptable at run time only from Python 3.11 on
    _LoggerAdapter = logging.LoggerAdapter


class _RankAdapter(_LoggerAdapter):
    """Prefixes every line with ``[job/rank/epoch/step]``."""

    def __init__(self, logger: logging.Logger, runtime: Runtime) -> None:
        super().__init__(logger, {"runtime": runtime})
        self.runtime = runtime

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[{self.runtime.tag}] {msg}", kwargs


class Runtime:
    """This process's place in the job, and its link to the supervisor.

    Make one with :func:`init` (or :meth:`from_env` then :meth:`start`).
    """

    def __init__(
        self,
        role: Role,
        info: RankInfo | None,
        *,
        environ: MutableMapping[str, str],
        client: ControlClientLike | None = None,
        config: SupervisorConfig | None = None,
    ) -> None:
        self.role = role
        self.info = info
        self.job_id = environ.get(ENV_JOB_ID) or environ.get("SLURM_JOB_ID") or "-"
        self.node = environ.get(ENV_NODE) or environ.get("SLURMD_NODENAME") or "-"
        self.step: int | None = None
        self.state = Phase.STARTING
        self.is_spare_promoted = False
        self.stop_requested = threading.Event()
        self.log = _RankAdapter(logger, self)
        self._environ = environ
        self._client = client
        self._config = config or SupervisorConfig.from_env(environ)
        self._heartbeat: Heartbeat | None = None
        #: messages for the supervisor, sent by the heartbeat thread
        self.outbox: queue.Queue[tuple[str, JSONObject]] = Outbox()
        #: reconfigure messages from the supervisor, for the training thread
        self.reconfigures: queue.Queue[Reconfigure] = queue.Queue()
        #: the promote message, for a promoted spare
        self.promotion: Promote | None = None
        self._health: HealthAgent | None = None
        self._seals = JobSeals(None if role is Role.PLAIN else environ.get(ENV_SECRET_FILE), self.job_id)
        self._rendezvous = EpochRendezvous(self.log, self._seals.secret)

    # -- construction --

    @classmethod
    def from_env(
        cls,
        environ: MutableMapping[str, str] | None = None,
        *,
        client_factory: ClientFactory | None = None,
        config: SupervisorConfig | None = None,
    ) -> Runtime:
        """Read the environment and connect (no message sent yet, never blocks)."""
        env = os.environ if environ is None else environ
        role = role_from_env(env)
        if role is Role.PLAIN:
            return cls(role, plain_rank_info(env), environ=env, config=config)
        info = active_rank_info(env) if role is Role.ACTIVE else None
        sender = f"{env.get(ENV_NODE) or env.get('SLURMD_NODENAME', '-')}/{env.get('SLURM_LOCALID', '0')}"
        client = (client_factory or connect_control)(env[ENV_CONTROL], _require(env, ENV_SECRET_FILE), sender)
        return cls(role, info, environ=env, client=client, config=config)

    def start(self, standby_timeout: datetime.timedelta | None = None) -> Runtime:
        """Join the job: export the rank env; active: hello + heartbeats; spare: wait first.

        A spare blocks until promoted (then continues as active) or stopped
        (then the process exits with status 0). ``standby_timeout`` None waits
        as long as the job runs; otherwise :class:`ControlPlaneError` after it.
        """
        if self.role is Role.SPARE:
            self._wait_for_promotion(standby_timeout)
        assert self.info is not None
        self.info.export(self._environ)
        self.state = Phase.RUNNING
        if self._client is not None:
            self._send(Kind.HELLO, self._hello_body())
            self._start_heartbeat()
            if self._health is not None:  # started in standby
                self._health.deliver(self.report)
            else:
                self._health = HealthAgent.maybe_start(
                    self.report, node=self.node, local_rank=self.info.local_rank
                )
        self.log.info(
            "%s rank %d of %d (local %d of %d)",
            self.role.value,
            self.rank,
            self.world_size,
            self.info.local_rank,
            self.info.local_world_size,
        )
        return self

    # -- public API --

    @property
    def rank(self) -> int:
        """Global rank (spares: only after promotion)."""
        return self._info().rank

    @property
    def world_size(self) -> int:
        """Number of active ranks."""
        return self._info().world_size

    @property
    def local_rank(self) -> int:
        """Rank within this node."""
        return self._info().local_rank

    @property
    def epoch(self) -> int:
        """Membership epoch this rank belongs to."""
        return self.info.epoch if self.info is not None else 0

    @property
    def tag(self) -> str:
        """``job/rank/epoch/step`` for log lines."""
        rank = str(self.info.rank) if self.info is not None else "spare"
        step = "-" if self.step is None else str(self.step)
        return f"{self.job_id}/{rank}/{self.epoch}/{step}"

    def transfer_seal(self, epoch: int, step: int, donor: int, receiver: int) -> Seal | None:
        """The seal of ``step``'s transfer from ``donor`` to ``receiver`` (``JobSeals``); None: unsealed."""
        return self._seals.seal(epoch, step, donor, receiver)

    def job_store(self, addr: str, port: int, timeout: datetime.timedelta) -> Any:
        """The connection to the job's store at ``addr:port``, reached with the job's secret
        (``rank/rendezvous.py``); ``timeout`` bounds its waits."""
        return self._rendezvous.store(addr, port, timeout)

    def report_step(self, step: int) -> None:
        """Record the step this rank has reached; the next heartbeat carries it."""
        self.step = step

    def init_process_group(
        self,
        backend: str | GroupBackend = "gloo",
        timeout: datetime.timedelta = DEFAULT_PG_TIMEOUT,
        rendezvous_timeout: datetime.timedelta | None = None,
    ) -> None:
        """Initialize torch.distributed for this rank's epoch.

        Under tp run the group meets in the supervisor's store under the prefix
        ``epoch<N>``, so that a later epoch can be built in the same processes
        (:meth:`rejoin`). Elsewhere it uses ``env://`` (MASTER_ADDR/PORT).
        ``timeout`` bounds every collective; ``rendezvous_timeout`` (default:
        the same) how long to wait for every rank to arrive.
        """
        self._rendezvous.join(self._info(), backend, timeout, rendezvous_timeout)

    def rejoin(
        self,
        body: Reconfigure,
        backend: str | GroupBackend = "gloo",
        timeout: datetime.timedelta = DEFAULT_PG_TIMEOUT,
        rendezvous_timeout: datetime.timedelta | None = None,
    ) -> None:
        """Drop the broken process group and build the one of a reconfigure message's epoch, as
        the backend decides (``rank/backends.py``: a reconfigure names no excluded rank, so
        the old group is destroyed and the new one meets in the epoch store)."""
        info = self._info()
        request = RebuildRequest(epoch=body.epoch, old_world=info.world_size, new_world=body.world_size)
        after = _next_epoch_info(info, body, request.rank_after(info.rank))

        def fresh() -> None:
            self.info = after
            self.init_process_group(backend, timeout, rendezvous_timeout)

        group_backend(backend).rebuild(request, fresh, self.log)
        self.info = after

    def report(self, event: ReportKind, **fields: Any) -> None:
        """Tell the supervisor a fact for the event log (sent at once by the heartbeat thread),
        checked here as the supervisor reads it (``control/reports.py``): ControlPlaneError
        if ``fields`` do not fit its kind (a bug of the caller, not a fault of the job)."""
        body = Report.of(event, rank=self.rank, **fields).to_body()
        if self._heartbeat is not None:
            self.outbox.put((Kind.REPORT, body))
        elif self._client is not None:
            self._send(Kind.REPORT, body)

    def wait_reconfigure(self, timeout: datetime.timedelta) -> Reconfigure | None:
        """The next reconfigure message from the supervisor, or None after ``timeout``."""
        try:
            return self.reconfigures.get(timeout=timeout.total_seconds())
        except queue.Empty:
            return None

    def close(self) -> None:
        """Stop the health agent, say bye to the supervisor and stop the heartbeat thread (idempotent)."""
        self.state = Phase.DONE
        health, self._health = self._health, None
        if health is not None:
            health.close()
        hb, self._heartbeat = self._heartbeat, None
        if hb is not None:
            hb.stop()
            hb.join(CLOSE_TIMEOUT.total_seconds() + self._config.heartbeat_interval)
            if hb.is_alive():
                self.log.warning("heartbeat thread did not stop within %s", CLOSE_TIMEOUT)
        elif self._client is not None:
            self._send(Kind.BYE, self._beat_body(state=Phase.DONE))
            self._client.close()
            self._client = None

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --

    def _info(self) -> RankInfo:
        if self.info is None:
            raise ControlPlaneError(
                "this spare has not been promoted yet; it has no rank",
                hint="call runtime.init() (or Runtime.start()) before using the rank",
            )
        return self.info

    def _send(self, kind: str, body: JSONObject) -> None:
        assert self._client is not None and self._heartbeat is None, "the heartbeat thread owns the client"
        self._client.send(kind, body)

    def _hello_body(self) -> JSONObject:
        info = self._info()
        return rank_bodies.Hello(
            node=self.node,
            rank=info.rank,
            local_rank=info.local_rank,
            role=Role.ACTIVE.value,
            pid=os.getpid(),
            world_size=info.world_size,
            epoch=info.epoch,
            promoted=self.is_spare_promoted,
        ).to_body()

    def _beat_body(self, state: str | None = None) -> JSONObject:
        rank = self.info.rank if self.info is not None else None
        return rank_bodies.Heartbeat(rank=rank, step=self.step, state=str(state or self.state)).to_body()

    def _start_heartbeat(self) -> None:
        assert self._client is not None
        hb = Heartbeat(
            self._client,
            self._config.heartbeat_interval,
            beat=self._beat_body,
            on_message=self._on_message,
            outbox=self.outbox,
            log=self.log,
            orphan=Orphan(
                self._environ, node=self.node, sender=str(getattr(self._client, "sender", "")), log=self.log
            ),
            node=node_beat(self._environ, self.job_id, self.node, self._info(), self.log),
        )
        self._heartbeat, self._client = hb, None  # the thread owns the client from here on
        hb.start()

    def _on_message(self, msg: Message) -> None:
        """A message for an active rank (called from the heartbeat thread)."""
        if msg.kind == Kind.RECONFIGURE:
            try:  # the group it supersedes is aborted before the training thread hears of it
                self.reconfigures.put(superseding(body_of(msg, Reconfigure), self.log))
            except ControlPlaneError as exc:
                self.log.warning("ignoring a malformed reconfigure: %s", exc)
        elif msg.kind == Kind.STOP:
            self.log.warning("the supervisor asked this rank to stop: %s", msg.body)
            self.stop_requested.set()
        else:
            self.log.warning("ignoring unexpected %r message while active", msg.kind)

    def _wait_for_promotion(self, timeout: datetime.timedelta | None) -> None:
        self.state = Phase.STANDBY
        assert self._client is not None
        local_rank = _int(self._environ, "SLURM_LOCALID", default=0)
        standby = rank_bodies.Standby(node=self.node, local_rank=local_rank, pid=os.getpid()).to_body()
        orphan = Orphan(
            self._environ, node=self.node, sender=str(getattr(self._client, "sender", "")), log=self.log
        )
        interval = datetime.timedelta(seconds=self._config.heartbeat_interval)
        self._health = HealthAgent.maybe_start(None, node=self.node, local_rank=local_rank)
        msg = wait_for_promotion(self._client, interval, standby, self._beat_body, self.log, timeout, orphan)
        if msg.kind == Kind.STOP:
            self._exit_on_stop(msg)
        try:
            self.promotion = body_of(msg, Promote)  # decode read it: the one parse of it
        except ControlPlaneError as exc:
            raise ControlPlaneError(f"malformed promote message: {exc.message}", hint=SKEW_HINT) from None
        self.info = promoted_rank_info(self.promotion, self._environ)
        self.is_spare_promoted = True
        self.log.info("promoted: %s", msg.body)

    def _exit_on_stop(self, msg: Message) -> None:
        self.log.info("stopped in standby: %s", msg.body)
        self.state = Phase.DONE
        self.close()
        raise SystemExit(0)

    def __repr__(self) -> str:
        return f"Runtime(role={self.role.value}, info={self.info}, promoted={self.is_spare_promoted})"


def _next_epoch_info(info: RankInfo, body: Reconfigure, rank: int) -> RankInfo:
    """``info`` in the epoch of ``body`` as ``rank``."""
    return RankInfo(
        rank=rank,
        world_size=body.world_size,
        local_rank=info.local_rank,
        local_world_size=info.local_world_size,
        master_addr=info.master_addr,
        master_port=info.master_port,
        epoch=body.epoch,
        store_addr=body.store_addr,
        store_port=body.store_port,
    )


def init(
    environ: MutableMapping[str, str] | None = None,
    *,
    client_factory: ClientFactory | None = None,
    config: SupervisorConfig | None = None,
    standby_timeout: datetime.timedelta | None = None,
) -> Runtime:
    """Join the job as described by the environment; see the module docstring.

    A spare blocks here until promoted; a spare told to stop exits the process
    with status 0.
    """
    return Runtime.from_env(environ, client_factory=client_factory, config=config).start(standby_timeout)
