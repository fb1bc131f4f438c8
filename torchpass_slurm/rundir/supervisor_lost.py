"""The record a rank leaves when the job's supervisor is gone: ``.torchpass/supervisor-lost.json``.

The first rank that finds the supervisor dead claims it (an exclusive create: one record per
job) before it cancels the job (``rank/orphan.py``); ``tp report`` and ``tp status`` read it
to say why the job ended.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["RECORD", "claim_record", "read_record"]

#: The record of the loss, in the run folder.
RECORD = Path(".torchpass") / "supervisor-lost.json"

logger = logging.getLogger(__name__)


def claim_record(run_dir: Path, record: Mapping[str, Any]) -> bool:
    """Write ``record`` unless another rank did (exclusive create); True when this call wrote it,
    or when it could not be written at all (said in a warning: the caller goes on as the claimant)."""
    path = Path(run_dir) / RECORD
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    except OSError as exc:
        logger.warning("cannot write %s: %s", path, exc)
        return True
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(dict(record)) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return True


def read_record(run_dir: Path) -> dict[str, Any] | None:
    """The run folder's supervisor-lost record, or None (none, or unreadable: said in a warning)."""
    path = Path(run_dir) / RECORD
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("cannot read %s: %s", path, exc)
        return None
    return value if isinstance(value, dict) else None
