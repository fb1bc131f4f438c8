"""Issue 26: the process-group seam's pure choices (``rank/backends.py``): which backend, which
rebuild, which settings, and the environment tp run gives every step for NCCL."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from torchpass_slurm import config as cfg
from torchpass_slurm.errors import ConfigError
from torchpass_slurm.rank import backends
from torchpass_slurm.rank.backends import (
    GlooBackend,
    NcclBackend,
    NcclCapabilities,
    Rebuild,
    RebuildRequest,
    choose_backend,
    choose_rebuild,
    group_backend,
)
from torchpass_slurm.supervisor.membership import Membership
from torchpass_slurm.supervisor.workers import StepLauncher

from ..supervisor.fakes import FakeSlurm, VirtualClock

# --- the backend rule ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("requested", "device", "nccl", "expected"),
    [
        ("gloo", "cuda", True, "gloo"),  # a name given wins
        ("nccl", "cpu", False, "nccl"),
        ("cpu:gloo,cuda:nccl", None, True, "cpu:gloo,cuda:nccl"),
        ("auto", "cuda", True, "nccl"),
        ("auto", torch.device("cuda", 1), True, "nccl"),
        (None, "cuda", True, "nccl"),
        ("auto", "cuda", False, "gloo"),  # a torch without NCCL
        ("auto", "cpu", True, "gloo"),
        ("auto", torch.device("cpu"), True, "gloo"),
        ("auto", None, True, "gloo"),  # nothing says: gloo
    ],
)
def test_the_backend_is_the_name_given_else_nccl_for_a_cuda_training(
    monkeypatch: pytest.MonkeyPatch, requested: str | None, device: Any, nccl: bool, expected: str
) -> None:
    monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)
    assert choose_backend(requested, device) == expected


def test_the_training_device_is_a_sharded_states_type_or_the_models_parameters() -> None:
    class Sharded:
        device_type = "cuda"

    class Replicated:
        model = torch.nn.Linear(2, 2)

    class Empty:
        model = torch.nn.Module()

    assert backends.training_device(Sharded()) == "cuda"
    assert backends.training_device(Replicated()) == torch.device("cpu")
    assert backends.training_device(Empty()) is None
    assert backends.training_device(object()) is None


@pytest.mark.parametrize(
    ("name", "kind"),
    [("nccl", NcclBackend), ("cpu:gloo,cuda:nccl", NcclBackend), ("gloo", GlooBackend), ("mpi", GlooBackend)],
)
def test_a_name_with_nccl_gets_the_nccl_backend_and_every_other_gloos(name: str, kind: type) -> None:
    seam = group_backend(name)
    assert type(seam) is kind and seam.name == name


def test_a_backend_object_is_its_own_backend() -> None:
    seam = NcclBackend("fake", options=None)
    assert group_backend(seam) is seam


# --- the rebuild table ---------------------------------------------------------------------------

SHRINKS = NcclCapabilities(nccl_version=(2, 27, 3), group_abort=True, shrink=True)
NO_SHRINK = NcclCapabilities(nccl_version=(2, 26, 2), group_abort=True, shrink=False)


@pytest.mark.parametrize(
    ("caps", "live", "request_", "expected"),
    [
        (NO_SHRINK, True, RebuildRequest(2, 4, 3, (1,)), Rebuild.FRESH),  # no shrink offered
        (SHRINKS, False, RebuildRequest(2, 4, 3, (1,)), Rebuild.FRESH),  # aborted: nothing to shrink
        (SHRINKS, True, RebuildRequest(2, 4, 4), Rebuild.FRESH),  # who left is unknown (a reconfigure)
        (SHRINKS, True, RebuildRequest(2, 4, 4, (1,)), Rebuild.FRESH),  # a spare joins: no grow
        (SHRINKS, True, RebuildRequest(2, 4, 3, (1,)), Rebuild.SHRINK),
        (SHRINKS, True, RebuildRequest(2, 4, 2, (0, 3)), Rebuild.SHRINK),
        (SHRINKS, True, RebuildRequest(2, 4, 3, (4,)), Rebuild.FRESH),  # no such rank
    ],
)
def test_the_rebuild_is_a_shrink_only_for_a_live_group_that_loses_named_ranks_and_gains_none(
    caps: NcclCapabilities, live: bool, request_: RebuildRequest, expected: Rebuild
) -> None:
    assert choose_rebuild(request_, caps, live) is expected


def test_a_shrunk_groups_ranks_close_the_gaps_as_ncclcommshrink_does() -> None:
    shrink = RebuildRequest(epoch=2, old_world=5, new_world=3, excluded=(1, 3))
    assert [shrink.rank_after(r) for r in (0, 2, 4)] == [0, 1, 2]
    keep = RebuildRequest(epoch=2, old_world=4, new_world=4)
    assert [keep.rank_after(r) for r in range(4)] == [0, 1, 2, 3]


def test_this_torch_offers_the_group_abort_and_no_shrink_without_nccl() -> None:
    caps = backends.nccl_capabilities()
    assert caps.group_abort  # distributed_c10d._abort_process_group in torch 2.13
    assert caps.nccl_version is None and not caps.shrink  # the CPU build


@pytest.mark.parametrize(
    ("version", "offered"), [((2, 27, 3), True), ((2, 30, 1), True), ((2, 27, 2), False)]
)
def test_shrink_needs_an_nccl_with_ncclcommshrink(
    monkeypatch: pytest.MonkeyPatch, version: tuple[int, int, int], offered: bool
) -> None:
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: version)
    caps = backends.nccl_capabilities()
    assert caps.nccl_version == version and caps.shrink is offered


# --- the communicator's options ------------------------------------------------------------------


def test_a_torch_without_nccl_cannot_give_nccl_options() -> None:
    with pytest.raises(ConfigError, match="no NCCL"):
        backends.nccl_options()


def test_the_nccl_options_make_a_non_blocking_communicator(monkeypatch: pytest.MonkeyPatch) -> None:
    class Config:
        blocking = 1

    class ProcessGroupNCCL:
        class Options:
            def __init__(self) -> None:
                self.config = Config()

    monkeypatch.setattr(dist, "ProcessGroupNCCL", ProcessGroupNCCL, raising=False)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert backends.nccl_options().config.blocking == 0


# --- the environment -----------------------------------------------------------------------------


def test_the_recovery_settings_keep_every_watchdog_from_ending_a_survivor() -> None:
    env = {name: value for name, (value, _) in cfg.NCCL_RECOVERY_ENV.items()}
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # abort the communicator, keep the process
    assert env["TORCH_NCCL_RETHROW_CUDA_ERRORS"] == "0"
    assert env["TORCH_NCCL_ENABLE_MONITORING"] == "0"
    assert env["TORCH_NCCL_USE_COMM_NONBLOCKING"] == "1"
    assert env["NCCL_NVLS_ENABLE"] == "0"
    assert all(reason for _, reason in cfg.NCCL_RECOVERY_ENV.values())


def test_a_setting_the_job_made_itself_wins_and_is_flagged_when_it_defeats_recovery() -> None:
    job = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "NCCL_NVLS_ENABLE": "0"}
    given = cfg.nccl_recovery_env(job)
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in given and "NCCL_NVLS_ENABLE" not in given
    assert given["TORCH_NCCL_RETHROW_CUDA_ERRORS"] == "0"
    assert backends.recovery_env_problems({**job, **given}) == ["TORCH_NCCL_ASYNC_ERROR_HANDLING=3 (want 2)"]
    assert backends.recovery_env_problems({}) == []


def launched_env(job_env: dict[str, str], base_env: dict[str, str] | None = None) -> dict[str, str]:
    clock = VirtualClock()
    slurm = FakeSlurm(clock, ["c1", "c2"])
    launcher = StepLauncher(
        slurm,
        job_id=7,
        command=("python", "train.py"),  # type: ignore[arg-type]
        control_endpoint="tcp://batch:5555",
        base_env=base_env or {},
        clock=clock,
        job_env=job_env,
    )
    launcher.launch("c1", Membership.initial(["c1", "c2"], 1, 1))
    return dict(slurm.launches[-1].env)


def test_tp_run_gives_every_step_the_nccl_recovery_settings_the_job_did_not_set() -> None:
    env = launched_env({"PATH": "/bin"})
    for name, (value, _) in cfg.NCCL_RECOVERY_ENV.items():
        assert env[name] == value
    mine = launched_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"})
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in mine  # srun passes the job's own on
    assert mine["TORCH_NCCL_ENABLE_MONITORING"] == "0"
