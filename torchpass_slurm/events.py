"""Deprecated import path: the event log lives in :mod:`torchpass_slurm.rundir.events` now.

This module keeps ``torchpass_slurm.events`` (``EventLog``, ``read_events``, the event
kinds) working, with a :class:`DeprecationWarning`, for one release.
"""

from __future__ import annotations

import warnings

from torchpass_slurm.rundir.events import *  # noqa: F403 (the old module's names, all of them)
from torchpass_slurm.rundir.events import __all__  # noqa: F401

warnings.warn(
    "torchpass_slurm.events is deprecated and goes in the next release: "
    "import from torchpass_slurm.rundir.events",
    DeprecationWarning,
    stacklevel=2,
)
