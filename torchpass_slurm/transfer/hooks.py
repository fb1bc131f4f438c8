"""Test hooks a donor reads from its environment: faults on cue, for the cluster tests.

Never set them in production; ``docs/design/runtime-contract.md`` lists them.

- ``TORCHPASS_TEST_CORRUPT_CHUNKS`` ("3,7"): those chunks get one byte flipped
  after their digest was computed, on their first transmission only.
- ``TORCHPASS_TEST_STALL_CHUNK`` ("K:S"): a donor waits S seconds before it
  sends chunk K, once in its process's life, so that a test can kill it
  mid-stream (the donor that takes over does not wait).

Each is read in one place, by the function below that names it.
"""

from __future__ import annotations

import os

from torchpass_slurm.errors import ConfigError

__all__ = [
    "ENV_CORRUPT_CHUNKS",
    "ENV_STALL_CHUNK",
    "corrupt_chunks_from_env",
    "stall_from_env",
    "take_stall",
]

#: Comma-separated chunk indices a donor corrupts on their first send.
ENV_CORRUPT_CHUNKS = "TORCHPASS_TEST_CORRUPT_CHUNKS"
#: "K:S": a donor waits S seconds before it sends chunk K, once per process.
ENV_STALL_CHUNK = "TORCHPASS_TEST_STALL_CHUNK"
#: The longest stall the hook accepts (seconds).
MAX_STALL_S = 3600.0
_stalled = False


def corrupt_chunks_from_env() -> frozenset[int]:
    """The chunk indices in TORCHPASS_TEST_CORRUPT_CHUNKS."""
    raw = os.environ.get(ENV_CORRUPT_CHUNKS, "").strip()
    if not raw:
        return frozenset()
    try:
        return frozenset(int(x) for x in raw.split(",") if x.strip())
    except ValueError:
        raise ConfigError(
            f"{ENV_CORRUPT_CHUNKS}={raw!r} is not a comma-separated list of chunk indices",
            hint="e.g. 3,7, or unset it",
        ) from None


def stall_from_env() -> tuple[int, float] | None:
    """The (chunk, seconds) in TORCHPASS_TEST_STALL_CHUNK, or None when it is unset."""
    raw = os.environ.get(ENV_STALL_CHUNK, "").strip()
    if not raw:
        return None
    chunk, _, seconds = raw.partition(":")
    try:
        stall = int(chunk), float(seconds)
    except ValueError:
        stall = (-1, -1.0)
    if stall[0] < 0 or not 0 <= stall[1] <= MAX_STALL_S:
        raise ConfigError(
            f"{ENV_STALL_CHUNK}={raw!r} is not CHUNK:SECONDS (a chunk index, 0 to {MAX_STALL_S:.0f} s)",
            hint="e.g. 1:30, or unset it",
        )
    return stall


def take_stall() -> tuple[int, float] | None:
    """The stall a donor must make now: :func:`stall_from_env` the first time it names one in
    this process, None ever after."""
    global _stalled
    stall = None if _stalled else stall_from_env()
    _stalled = _stalled or stall is not None
    return stall
