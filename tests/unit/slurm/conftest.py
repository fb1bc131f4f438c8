"""Fakes and fixture loaders for the Slurm layer's unit tests.

:class:`FakeRunner` answers only the commands a test told it about and fails
the test on any other (submitit style): a test can never reach a real Slurm
by accident, and every argv the code builds is checked exactly.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from torchpass_slurm.slurm.runner import CommandResult

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "slurm"
VERSIONS = ("22.05", "24.11")


def fixture_text(version: str, name: str) -> str:
    """The recorded output ``tests/fixtures/slurm/<version>/<name>``."""
    return (FIXTURES / version / name).read_text()


@dataclass
class Call:
    argv: tuple[str, ...]
    input: str | None = None
    env: Mapping[str, str] | None = None


@dataclass
class FakeRunner:
    """A :class:`~torchpass_slurm.slurm.runner.Runner` with canned answers."""

    answers: dict[tuple[str, ...], str | BaseException] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)

    def on(self, argv: Sequence[str], answer: str | BaseException = "") -> FakeRunner:
        self.answers[tuple(argv)] = answer
        return self

    def run(
        self,
        argv: Sequence[str],
        *,
        input: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> CommandResult:
        key = tuple(argv)
        self.calls.append(Call(key, input, env))
        if key not in self.answers:
            pytest.fail(f"FakeRunner: unexpected command {list(key)}; known: {list(self.answers)}")
        answer = self.answers[key]
        if isinstance(answer, BaseException):
            raise answer
        return CommandResult(key, answer)

    def spawn(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
        key = tuple(argv)
        self.calls.append(Call(key, None, env))
        if key not in self.answers:
            pytest.fail(f"FakeRunner: unexpected spawn {list(key)}")
        return subprocess.Popen(["true"])


@pytest.fixture
def fake_runner() -> FakeRunner:
    return FakeRunner()
