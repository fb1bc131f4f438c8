"""ElasticTrainer in one process: the commit rule, errors, and one recovery through a real 1-rank group."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from torchpass_slurm.control.bodies import Reconfigure
from torchpass_slurm.errors import CheckpointError, RendezvousTimeout, TransferError, TransferTimeout
from torchpass_slurm.rank import elastic
from torchpass_slurm.rank.elastic import ElasticTrainer, is_comm_error
from torchpass_slurm.rank.runtime import RankInfo, Role, Runtime

from ..gloo_ranks import FakeClient, loopback_store

GLOO_RESET = RuntimeError(
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:41234"
)


@pytest.mark.parametrize(
    "exc",
    [
        GLOO_RESET,
        RuntimeError("NCCL communicator was aborted on rank 1"),
        RuntimeError("[Rank 0]: Ranks 2 failed to pass monitoredBarrier in 15000 ms (Socket Timeout)"),
        # a survivor in the handover barrier when the donor, rank 0, died mid-stream (issue 24)
        RuntimeError(
            "Rank 2 successfully reached monitoredBarrier, but received errors while waiting"
            " for send/recv from rank 0. Please check rank 0 logs for faulty rank.\n"
            " Original exception: \n[../third_party/gloo/gloo/transport/tcp/pair.cc:534]"
            " Connection closed by peer [172.29.77.12]:41786"
        ),
        RuntimeError(
            "Rank 1 successfully reached monitoredBarrier, but received errors while waiting"
            " for send/recv from rank 0. Please check rank 0 logs for faulty rank."
        ),
        TransferError("receiving chunk 3 from rank 0: the peer closed the connection"),
        TransferTimeout("recv of 4096 bytes did not finish within 0:02:00"),
        RendezvousTimeout("rendezvous of epoch 2 timed out after 0:02:00: 2 of 3 ranks arrived"),
        dist.DistError("store client disconnected"),
    ],
    ids=[
        "gloo",
        "nccl",
        "barrier-timeout",
        "barrier-donor-died",
        "barrier-donor-died-bare",
        "transfer",
        "transfer-timeout",
        "rendezvous",
        "dist-error",
    ],
)
def test_a_failed_collective_is_a_comm_error(exc: BaseException) -> None:
    assert is_comm_error(exc)


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("connection reset by peer"),  # only RuntimeErrors are judged by their text
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x16 and 32x4)"),
        RuntimeError("element 0 of tensors does not require grad and does not have a grad_fn"),
        KeyError("model"),
    ],
    ids=["value-error", "shape", "no-grad", "key-error"],
)
def test_a_bug_is_not_a_comm_error(exc: BaseException) -> None:
    assert not is_comm_error(exc)


class CountingSGD(torch.optim.SGD):
    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.steps = 0

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        self.steps += 1
        return super().step(closure)


def plain() -> Runtime:
    return Runtime.from_env({})  # no TORCHPASS_CONTROL, no WORLD_SIZE: one plain rank


def active(client: FakeClient) -> Runtime:
    info = RankInfo(
        rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr=None, master_port=None
    )
    return Runtime(Role.ACTIVE, info, environ={}, client=client)


def trainer_for(rt: Runtime, **kwargs: Any) -> tuple[ElasticTrainer, nn.Linear, CountingSGD]:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = CountingSGD(model.parameters(), lr=0.1)
    trainer = ElasticTrainer(rt, model, optimizer, state={"model": model, "optim": optimizer}, **kwargs)
    return trainer, model, optimizer


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    x = torch.full((2, 4), float(step + 1))
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss


def fails_once(at: int, calls: list[int] | None = None) -> Callable[[int, nn.Module], torch.Tensor]:
    """A train_step whose first try of step ``at`` does its backward, then its all-reduce fails."""
    pending = [GLOO_RESET]

    def train_step(step: int, m: nn.Module) -> torch.Tensor:
        if calls is not None:
            calls.append(step)
        loss = loss_of(m, step)
        if step == at and pending:
            raise pending.pop()
        return loss

    return train_step


def test_fit_commits_every_step_once_on_one_plain_rank() -> None:
    rt = plain()
    trainer, model, optimizer = trainer_for(rt)
    calls: list[int] = []
    commits: list[int] = []

    def train_step(step: int, ddp_model: nn.Module) -> torch.Tensor:
        assert ddp_model is model  # one rank: no DDP wrapper
        calls.append(step)
        return loss_of(ddp_model, step)

    loss = trainer.fit(train_step, steps=5, on_commit=lambda step, _: commits.append(step))

    assert not dist.is_initialized()
    assert calls == [0, 1, 2, 3, 4]
    assert commits == [1, 2, 3, 4, 5]  # on_commit sees the step count after the commit
    assert (optimizer.steps, trainer.step, rt.step) == (5, 5, 5)
    assert loss is not None and loss.item() >= 0


def test_fit_resumes_at_start_step_and_steps_the_scheduler_per_commit() -> None:
    trainer, _, optimizer = trainer_for(plain(), start_step=3)
    trainer.scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    calls: list[int] = []

    trainer.fit(lambda step, m: (calls.append(step), loss_of(m, step))[1], steps=5)

    assert calls == [3, 4]
    assert optimizer.steps == 2
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)


def test_a_failure_before_the_commit_applies_nothing() -> None:
    trainer, model, optimizer = trainer_for(plain())
    snapshot: dict[str, torch.Tensor] = {}

    def train_step(step: int, m: nn.Module) -> torch.Tensor:
        loss = loss_of(m, step)  # the gradients are there...
        if step == 2:
            snapshot.update({k: v.clone() for k, v in model.state_dict().items()})
            raise ValueError("bad batch")  # ...but the step fails before its commit
        return loss

    with pytest.raises(ValueError, match="bad batch"):
        trainer.fit(train_step, steps=5)

    assert (optimizer.steps, trainer.step) == (2, 2)
    assert all(torch.equal(v, snapshot[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("error", [ValueError("a bug"), GLOO_RESET], ids=["bug", "comm-error"])
def test_a_plain_run_raises_at_once_without_waiting_for_a_reconfigure(error: Exception) -> None:
    trainer, _, optimizer = trainer_for(plain())

    def train_step(step: int, m: nn.Module) -> torch.Tensor:
        if step == 1:
            raise error
        return loss_of(m, step)

    began = time.monotonic()
    with pytest.raises(type(error)) as raised:
        trainer.fit(train_step, steps=3)

    assert raised.value is error
    assert time.monotonic() - began < 5  # not RECONFIGURE_TIMEOUT (120 s)
    assert optimizer.steps == 1


def test_a_bug_in_on_commit_propagates_after_the_step_counted() -> None:
    trainer, _, optimizer = trainer_for(plain())

    def on_commit(step: int, loss: torch.Tensor) -> None:
        if step == 2:
            raise KeyError("metrics")

    with pytest.raises(KeyError):
        trainer.fit(loss_of_step, steps=5, on_commit=on_commit)

    assert (optimizer.steps, trainer.step) == (2, 2)


def loss_of_step(step: int, m: nn.Module) -> torch.Tensor:
    return loss_of(m, step)


def test_an_active_rank_without_a_reconfigure_raises_the_original_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(elastic, "RECONFIGURE_TIMEOUT", datetime.timedelta(seconds=0.05))
    monkeypatch.setenv("TORCHPASS_SPARE_WAIT", "0")  # no hold for a spare to wait through either
    client = FakeClient()
    trainer, _, optimizer = trainer_for(active(client))

    with pytest.raises(RuntimeError) as raised:
        trainer.fit(fails_once(at=2), steps=5)

    assert raised.value is GLOO_RESET
    assert optimizer.steps == 2
    assert [e for e, _ in client.reports()] == ["live_ready", "collective_failed"]
    failed = client.reports()[1][1]
    assert (failed["rank"], failed["step"], failed["epoch"]) == (0, 2, 0)
    assert "Connection closed by peer" in failed["error"]


@pytest.fixture
def store() -> Iterator[int]:
    """A rendezvous store on 127.0.0.1, as tp run hosts one; its port. Leaves no process group."""
    with loopback_store() as port:
        yield port


def reconfigure(rt: Runtime, store: int, *epochs: int) -> None:
    """Queue the supervisor's reconfigure of each epoch, as the heartbeat thread does."""
    for epoch in epochs:
        rt.reconfigures.put(Reconfigure(epoch=epoch, world_size=1, store_addr="127.0.0.1", store_port=store))


def test_an_active_rank_rejoins_the_reconfigured_epoch_and_retries_the_step(store: int) -> None:
    client = FakeClient()
    rt = active(client)
    trainer, _, optimizer = trainer_for(rt)
    reconfigure(rt, store, 1)
    calls: list[int] = []

    trainer.fit(fails_once(at=2, calls=calls), steps=4)

    assert calls == [0, 1, 2, 2, 3]  # step 2 computed again, in epoch 1
    assert (optimizer.steps, trainer.step, trainer.migrations) == (4, 4, 1)
    assert (rt.epoch, rt.info.store_port, dist.get_world_size()) == (1, store, 1)
    events = client.reports()
    assert [e for e, _ in events] == [
        "live_ready",
        "collective_failed",
        "group_rebuilt",
        "agreement",
        "first_step",
    ]
    fields = dict(events)
    assert (fields["collective_failed"]["epoch"], fields["group_rebuilt"]["epoch"]) == (0, 1)
    assert {k: fields["agreement"][k] for k in ("committed_step", "receivers", "donors", "epoch")} == {
        "committed_step": 2,
        "receivers": [],
        "donors": [0],
        "epoch": 1,
    }
    assert (fields["first_step"]["step"], fields["first_step"]["epoch"]) == (3, 1)


def test_a_recovery_that_fails_again_waits_for_the_next_epoch(
    store: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = FakeClient()
    rt = active(client)
    trainer, _, optimizer = trainer_for(rt)
    reconfigure(rt, store, 1, 2)
    real_rejoin = rt.rejoin

    def rejoin(message: Reconfigure, *args: Any) -> None:
        if message.epoch == 1:  # another rank died while this one rejoined
            raise RendezvousTimeout("rendezvous of epoch 1 timed out after 0:02:00: 1 of 2 ranks arrived")
        real_rejoin(message, *args)

    monkeypatch.setattr(rt, "rejoin", rejoin)

    trainer.fit(fails_once(at=1), steps=3)

    assert (optimizer.steps, trainer.step, trainer.migrations, rt.epoch) == (3, 3, 1, 2)
    assert [e for e, _ in client.reports()] == [
        "live_ready",
        "collective_failed",
        "collective_failed",
        "group_rebuilt",
        "agreement",
        "first_step",
    ]
    second = client.reports()[2][1]
    assert "rendezvous of epoch 1 timed out" in second["error"]


def test_a_bug_during_the_recovery_is_raised(store: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rt = active(FakeClient())
    trainer, _, _ = trainer_for(rt)
    reconfigure(rt, store, 1)

    def rejoin(*args: Any) -> None:
        raise KeyError("store_port")

    monkeypatch.setattr(rt, "rejoin", rejoin)

    with pytest.raises(KeyError):
        trainer.fit(fails_once(at=0), steps=2)


def test_a_recovery_on_a_backend_other_than_plain_gloo_completes(store: int) -> None:
    rt = active(FakeClient())
    trainer, _, optimizer = trainer_for(rt, backend="cpu:gloo")  # CPU stand-in for nccl / mixed
    reconfigure(rt, store, 1)

    trainer.fit(fails_once(at=1), steps=3)

    assert (optimizer.steps, trainer.migrations, rt.epoch) == (3, 1, 1)


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("timeout while reading shard 7 of the dataset"),
        RuntimeError("connection to the metrics server closed"),
        RuntimeError("socket error in my data loader (reset by peer)"),
    ],
    ids=["timeout", "connection", "socket"],
)
def test_a_user_error_that_mentions_the_network_is_not_a_comm_error(exc: BaseException) -> None:
    """Only torch.distributed's own errors start a recovery, never words in a user's message."""
    assert not is_comm_error(exc)


def test_torch_gloo_errors_are_comm_errors() -> None:
    """The texts torch 2.13's gloo raised here for a killed and for a hung peer, and the one
    Debian's torch 2.6 raised on the dev cluster in a survivor that waited on a powered-off node."""
    for text in (
        "Application timeout caused pair closure",
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
        "[127.0.0.1]:54679: Connection reset by peer.",
        "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
        "waiting 3000ms for recv operation to complete",
    ):
        assert is_comm_error(RuntimeError(text))


def _raised_from(error: BaseException, cause: BaseException) -> BaseException:
    try:
        raise error from cause
    except BaseException as exc:
        return exc


def _raised_while_handling(error: BaseException, first: BaseException) -> BaseException:
    try:
        try:
            raise first
        except BaseException:
            raise error  # noqa: B904 - an implicit context on purpose
    except BaseException as exc:
        return exc


def test_an_error_raised_from_a_failed_collective_is_a_comm_error() -> None:
    """A peer died inside a checkpoint's gather (seen on the cluster: the rank exited 1 and was
    blamed for its peer's death); checkpoint.save raises CheckpointError from gloo's error."""
    wrapped = _raised_from(CheckpointError("saving the checkpoint of step 12 failed"), GLOO_RESET)
    assert is_comm_error(wrapped)
    assert is_comm_error(_raised_from(ValueError("outer"), wrapped))  # however deep
    assert not is_comm_error(_raised_from(RuntimeError("a bug"), ValueError("another bug")))
    # an error raised while handling a failed collective (not from it) is the handler's own
    assert not is_comm_error(_raised_while_handling(KeyError("model"), GLOO_RESET))


class PhaseClient(FakeClient):
    """Records the rank's phase when each report is sent."""

    def __init__(self) -> None:
        super().__init__()
        self.rt: Runtime | None = None
        self.phase_at: dict[str, str] = {}

    def send(self, kind: str, body: dict[str, Any]) -> None:
        super().send(kind, body)
        if kind == "report" and self.rt is not None:
            self.phase_at[body["event"]] = self.rt.state


def test_the_heartbeat_phase_follows_the_loop(store: int) -> None:
    """compute in the step, hook in on_commit, recovering from a failed collective until the new
    epoch's first step, running after the loop: what the supervisor's hang detector reads."""
    client = PhaseClient()
    rt = client.rt = active(client)
    trainer, _, _ = trainer_for(rt)
    reconfigure(rt, store, 1)
    seen: list[tuple[str, int]] = []
    step_fails = fails_once(at=1)

    def train_step(step: int, m: nn.Module) -> torch.Tensor:
        seen.append((rt.state, step))
        return step_fails(step, m)

    trainer.fit(train_step, steps=2, on_commit=lambda step, _: seen.append((rt.state, step)))

    assert seen == [("compute", 0), ("hook", 1), ("compute", 1), ("compute", 1), ("hook", 2)]
    assert (client.phase_at["collective_failed"], client.phase_at["group_rebuilt"]) == (
        "recovering",
        "recovering",
    )
    assert rt.state == "running"


def test_a_rank_waits_for_its_reconfigure_as_long_as_the_supervisor_may_hold_for_a_spare(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TORCHPASS_SPARE_WAIT", "45")
    assert elastic.reconfigure_timeout() == elastic.RECONFIGURE_TIMEOUT + datetime.timedelta(seconds=45)
    monkeypatch.setenv("TORCHPASS_SPARE_WAIT", "0")
    assert elastic.reconfigure_timeout() == elastic.RECONFIGURE_TIMEOUT
