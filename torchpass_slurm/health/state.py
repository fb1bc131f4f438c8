"""The small state file that lets a rate be measured across runs (corrected ECC errors).

Form: ``{"version": 1, "ecc": {"<gpu uuid>": {"ecc_corrected": N, "time": T}},
"drained": {"reason": "torchpass: ...", "time": T}}``; ``drained`` is set by
``tp health node-check`` when it drains this node, so that auto-resume asks
Slurm about the node only when torchpass may have drained it.
A missing or unreadable file means "no earlier sample" (the rate check says so and
passes); failing to write it is logged, never fatal: the checks do not depend on it.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torchpass_slurm.health.config import HealthConfig
from torchpass_slurm.health.facts import EccSample, Facts

logger = logging.getLogger(__name__)

__all__ = ["drained_marker", "next_samples", "read_samples", "set_drained_marker", "write_samples"]


def _read(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        logger.warning("ignoring the health state file %s: %s", path, err)
        return {}
    return data if isinstance(data, dict) else {}


def read_samples(path: str | os.PathLike[str]) -> dict[str, EccSample]:
    """The stored samples by GPU uuid; empty when there is no usable file."""
    try:
        return {
            uuid: EccSample(uuid, int(s["ecc_corrected"]), float(s["time"]))
            for uuid, s in _read(path).get("ecc", {}).items()
        }
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        logger.warning("ignoring the ECC samples in %s: %s", path, err)
        return {}


def drained_marker(path: str | os.PathLike[str]) -> str | None:
    """The reason node-check drained this node with, if it did and has not resumed it since."""
    marker = _read(path).get("drained")
    return marker.get("reason") if isinstance(marker, dict) else None


def set_drained_marker(path: str | os.PathLike[str], reason: str | None, now: float) -> None:
    """Record (``reason``) or clear (None) that torchpass drained this node."""
    doc = _read(path)
    if reason is None:
        doc.pop("drained", None)
    else:
        doc["drained"] = {"reason": reason, "time": now}
    _write(path, doc)


def next_samples(facts: Facts, config: HealthConfig) -> dict[str, EccSample]:
    """What to store after this run: a GPU's sample is replaced once it is older than
    ``ecc_rate_window_s`` (or when there is none, or the counter went down)."""
    samples = dict(facts.previous_ecc)
    for gpu in facts.gpus or ():
        if gpu.ecc_corrected is None:
            continue
        before = samples.get(gpu.uuid)
        if (
            before is None
            or facts.time - before.time >= config.ecc_rate_window_s
            or gpu.ecc_corrected < before.ecc_corrected
        ):
            samples[gpu.uuid] = EccSample(gpu.uuid, gpu.ecc_corrected, facts.time)
    return samples


def write_samples(path: str | os.PathLike[str], samples: Mapping[str, EccSample]) -> None:
    """Store ``samples``, keeping the rest of the file."""
    doc = _read(path)
    doc["ecc"] = {u: {"ecc_corrected": s.ecc_corrected, "time": s.time} for u, s in samples.items()}
    _write(path, doc)


def _write(path: str | os.PathLike[str], doc: dict[str, Any]) -> None:
    """Write atomically (temp file + rename); log and carry on when that fails."""
    target = Path(path)
    doc["version"] = 1
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".health-state.")
        with os.fdopen(fd, "w") as out:
            json.dump(doc, out)
        os.replace(tmp, target)
    except OSError as err:
        logger.warning("cannot write the health state file %s: %s", target, err)
