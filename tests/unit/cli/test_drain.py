"""``tp drain``: a reason Slurm would refuse is a usage error (exit 2) before Slurm is asked."""

from __future__ import annotations

import pytest

from torchpass_slurm import slurm

from .conftest import tp


@pytest.mark.parametrize(
    ("reason", "said"),
    [
        (" ", "must not be blank; say why the node is drained"),
        ("\t  ", "must not be blank"),
        ("", "must not be blank"),
        ("firmware\nupdate", "control character(s) '\\n'"),
        ("bad\x1b[2Jscreen", "control character(s) '\\x1b'"),
    ],
)
def test_a_reason_slurm_cannot_keep_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, reason: str, said: str
) -> None:
    def no_slurm() -> None:
        raise AssertionError("Slurm was asked")

    monkeypatch.setattr(slurm, "select_backend", no_slurm)

    result = tp("drain", "c1", "--reason", reason)

    assert result.code == 2 and result.out == ""
    assert "Invalid value for '--reason'" in result.err and said in result.err, result.err
