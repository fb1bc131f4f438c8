"""benchmarks/runs.py's sizing: where the completion runs' faults strike."""

from __future__ import annotations

import pytest

from benchmarks import runs


@pytest.mark.parametrize(
    ("size", "failures", "steps"),
    [
        (runs.Sizing(), 1, (50,)),
        (runs.Sizing(), 2, (30, 70)),
        (runs.QUICK, 1, (25,)),
        (runs.QUICK, 2, (15, 35)),
    ],
)
def test_faults_strike_half_a_checkpoint_interval_after_a_checkpoint(
    size: runs.Sizing, failures: int, steps: tuple[int, ...]
) -> None:
    assert size.fault_steps(failures) == steps
    assert all(s % size.ckpt_every == size.ckpt_every // 2 and s < size.completion_steps for s in steps)


def test_the_default_sizing_kills_two_nodes_at_steps_30_and_70() -> None:
    size = runs.Sizing()
    assert size.fault_steps(size.completion_failures) == (30, 70)
