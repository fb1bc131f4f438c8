"""MPITransport's blocking calls: an MPI error is a TransferError, anything else stays what it is.

A fake ``MPI`` module stands in for mpi4py, so this runs where mpi4py is not installed;
the contract tests prove the transport against the real library.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from datetime import timedelta

import pytest

from torchpass_slurm.errors import TransferError, TransferTimeout
from torchpass_slurm.transfer import mpi_transport


class MPIException(Exception):
    """mpi4py's MPI.Exception."""


@pytest.fixture(autouse=True)
def fake_mpi(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mpi_transport, "_mpi", lambda: types.SimpleNamespace(Exception=MPIException))


def raises(exc: BaseException) -> Callable[[], None]:
    def call() -> None:
        raise exc

    return call


def test_an_mpi_error_is_a_transfer_error() -> None:
    with pytest.raises(TransferError, match=r"^mpi: accept failed: MPI_ERR_PORT: invalid port$") as info:
        mpi_transport._blocking_within(
            raises(MPIException("MPI_ERR_PORT: invalid port\nmore")), timedelta(seconds=5), "accept"
        )
    assert isinstance(info.value.__cause__, MPIException)


def test_a_bug_in_the_call_is_not_taken_for_a_transfer_error() -> None:
    with pytest.raises(TypeError, match="a bug"):
        mpi_transport._blocking_within(raises(TypeError("a bug")), timedelta(seconds=5), "connect")


def test_a_call_that_does_not_return_times_out() -> None:
    import threading

    never = threading.Event()
    with pytest.raises(TransferTimeout):
        mpi_transport._blocking_within(never.wait, timedelta(seconds=0.05), "connect")
    never.set()


def test_the_value_comes_back() -> None:
    assert mpi_transport._blocking_within(lambda: 42, timedelta(seconds=5), "connect") == 42
