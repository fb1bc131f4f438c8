"""Where a rank sits in the job: its role and torch.distributed coordinates (pure).

Read from the environment contract (``docs/design/runtime-contract.md``) or
from a spare's promote message; :mod:`torchpass_slurm.rank.runtime` uses these.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from torchpass_slurm.config import (
    ENV_CONTROL,
    ENV_EPOCH,
    ENV_NTASKS_PER_NODE,
    ENV_RANK_BASE,
    ENV_ROLE,
    ENV_STORE,
    NodeRole,
)
from torchpass_slurm.control.bodies import Promote
from torchpass_slurm.errors import ConfigError
from torchpass_slurm.strenum import StrEnum

__all__ = ["Role", "RankInfo", "plain_rank_info", "active_rank_info", "promoted_rank_info", "role_from_env"]


class Role(StrEnum):
    """How this process takes part in the job."""

    PLAIN = "plain"  # no supervisor: torchrun / srun environment
    ACTIVE = NodeRole.ACTIVE.value  # a rank of the current epoch
    SPARE = NodeRole.SPARE.value  # a hot spare in standby


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the torch.distributed world of one epoch."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None
    epoch: int = 0
    #: the job's rendezvous store (hosted by the supervisor), when tp run gives one
    store_addr: str | None = None
    store_port: int | None = None

    def export(self, environ: MutableMapping[str, str]) -> None:
        """Write the torch.distributed ``env://`` variables into ``environ``."""
        environ["RANK"] = str(self.rank)
        environ["WORLD_SIZE"] = str(self.world_size)
        environ["LOCAL_RANK"] = str(self.local_rank)
        environ["LOCAL_WORLD_SIZE"] = str(self.local_world_size)
        if self.master_addr is not None:
            environ["MASTER_ADDR"] = self.master_addr
        if self.master_port is not None:
            environ["MASTER_PORT"] = str(self.master_port)


# --- environment -> RankInfo (pure) -------------------------------------------------


def _int(env: Mapping[str, str], *names: str, default: int | None = None) -> int:
    """The first of ``names`` set in ``env``, as an int; ``default`` None makes it required."""
    for name in names:
        raw = env.get(name, "")
        if raw != "":
            head = raw.split("(")[0].split(",")[0]  # SLURM_TASKS_PER_NODE-style "2(x3)"
            try:
                return int(head)
            except ValueError:
                raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if default is None:
        raise ConfigError(
            f"none of {', '.join(names)} is set in the environment",
            hint="run this under tp run (tp-submit), srun or torchrun, which set them",
        )
    return default


def _port(env: Mapping[str, str]) -> int | None:
    return _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else None


def plain_rank_info(env: Mapping[str, str]) -> RankInfo:
    """Rank info outside tp run: torchrun's variables, else srun's, else a single process."""
    world = _int(env, "WORLD_SIZE", "SLURM_NTASKS", default=1)
    addr = env.get("MASTER_ADDR") or ("127.0.0.1" if world == 1 else None)
    port = _port(env) or (29500 if world == 1 else None)
    return RankInfo(
        rank=_int(env, "RANK", "SLURM_PROCID", default=0),
        world_size=world,
        local_rank=_int(env, "LOCAL_RANK", "SLURM_LOCALID", default=0),
        local_world_size=_int(env, "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", default=1),
        master_addr=addr,
        master_port=port,
    )


def active_rank_info(env: Mapping[str, str]) -> RankInfo:
    """Rank info of an active step launched by tp run: rank = RANK_BASE + SLURM_LOCALID."""
    local = _int(env, "SLURM_LOCALID", default=0)
    return RankInfo(
        rank=_int(env, ENV_RANK_BASE) + local,
        world_size=_int(env, "WORLD_SIZE"),
        local_rank=local,
        local_world_size=_int(env, "SLURM_NTASKS_PER_NODE", ENV_NTASKS_PER_NODE, default=1),
        master_addr=_require(env, "MASTER_ADDR"),
        master_port=_int(env, "MASTER_PORT"),
        epoch=_int(env, ENV_EPOCH, default=0),
        **_store_of(env.get(ENV_STORE)),
    )


def _store_of(value: str | None) -> dict[str, Any]:
    """``host:port`` -> RankInfo's store fields (empty when not given)."""
    if not value:
        return {}
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"{ENV_STORE}={value!r} is not HOST:PORT")
    return {"store_addr": host, "store_port": int(port)}


def promoted_rank_info(promote: Promote, env: Mapping[str, str]) -> RankInfo:
    """Rank info of a spare from its promote message (parsed once, by ``Promote.from_body``)."""
    return RankInfo(
        rank=promote.rank,
        world_size=promote.world_size,
        local_rank=promote.local_rank,
        local_world_size=_int(env, "SLURM_NTASKS_PER_NODE", ENV_NTASKS_PER_NODE, default=1),
        master_addr=promote.master_addr,
        master_port=promote.master_port,
        epoch=promote.epoch,
        store_addr=promote.store_addr or None,
        store_port=promote.store_port or None,
    )


def _require(env: Mapping[str, str], name: str) -> str:
    value = env.get(name, "")
    if not value:
        raise ConfigError(
            f"the environment variable {name} is not set",
            hint="tp run sets it for active steps; is this an old tp run?",
        )
    return value


def role_from_env(env: Mapping[str, str]) -> Role:
    """The role this process was launched in."""
    if not env.get(ENV_CONTROL):
        return Role.PLAIN
    raw = env.get(ENV_ROLE, "")
    try:
        role = Role(raw)
    except ValueError:
        raise ConfigError(f"{ENV_ROLE}={raw!r} is not a role", hint="expected 'active' or 'spare'") from None
    if role is Role.PLAIN:
        raise ConfigError(
            f"{ENV_ROLE}=plain together with {ENV_CONTROL}", hint="expected 'active' or 'spare'"
        )
    return role
