"""results/MANIFEST.json: which command, commit, date and host made each result file.

Every file in ``benchmarks/results/`` has an entry there, and every entry a file
(``tests/unit/benchmarks/test_manifest.py``). An entry::

    "peers-2026-12-01.json": {
        "command": "TP_CLUSTER_FLAVOR=bookworm python3 -m benchmarks.peers",
        "commit": "f6847a0",         # the code measured ("-dirty": with uncommitted changes)
        "committed_in": "fb391c1",   # the commit that wrote this file into the repository
        "date": "2026-12-01T19:40:46Z",
        "host": "vm (2 CPUs), bookworm dev cluster (Slurm 22.05.8, torch 2.13 CPU)",
        "current_for": ["Against the peers: torchft, checkpoint restart, requeue"],
        "note": "..."
    }

``current_for`` names the headings of docs/benchmarks.md whose numbers are this file's; an
empty list means the page cites another run (or none). What is not known is "unknown".

The suite's writers call :func:`write_result`: it stamps the result with its provenance
(``result["provenance"]``: command, commit, date, host) and writes the entry, so a new file is
never without one. ``committed_in`` and ``current_for`` are for the person who commits the
result and updates the page: a rewritten file keeps its ``current_for``, a new one starts
with none.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MANIFEST = RESULTS / "MANIFEST.json"
UNKNOWN = "unknown"
#: Where the code that runs on the nodes comes from: a change here makes the commit "-dirty".
CODE = ("torchpass_slurm", "benchmarks", "sbatch-examples", "docker")


def command() -> str:
    """This process's command line, as a person would type it again."""
    argv = list(getattr(sys, "orig_argv", sys.argv))
    if argv and Path(argv[0]).name.startswith("python"):
        argv[0] = "python3"
    flavor = os.environ.get("TP_CLUSTER_FLAVOR")
    return (f"TP_CLUSTER_FLAVOR={flavor} " if flavor else "") + shlex.join(argv)


def commit(root: Path = ROOT) -> str:
    """The checkout's commit, with "-dirty" if the measured code has uncommitted changes."""
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", *CODE],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN
    return f"{head}-dirty" if dirty else head


def host() -> str:
    flavor = os.environ.get("TP_CLUSTER_FLAVOR", "trixie")
    return f"{platform.node()} ({os.cpu_count()} CPUs); dev cluster flavor if any: {flavor}"


def provenance() -> dict[str, str]:
    return {
        "command": command(),
        "commit": commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": host(),
    }


def load(path: Path = MANIFEST) -> dict[str, Any]:
    return json.loads(path.read_text())


def record(result: Path, stamp: Mapping[str, str], manifest: Path = MANIFEST) -> None:
    """Add or replace ``result``'s entry, if it lies in the manifest's folder."""
    result = result.resolve()
    if result.parent != manifest.resolve().parent:
        return
    data = load(manifest) if manifest.exists() else {"files": {}}
    before = data["files"].get(result.name, {})
    data["files"][result.name] = {
        **stamp,
        "committed_in": UNKNOWN,  # not yet: the commit that adds the file says it
        "current_for": before.get("current_for", []),
        "note": "written by the benchmark; check current_for against docs/benchmarks.md",
    }
    data["files"] = dict(sorted(data["files"].items()))
    manifest.write_text(json.dumps(data, indent=2) + "\n")


def write_result(path: Path, result: dict[str, Any], *, indent: int = 1, manifest: Path = MANIFEST) -> None:
    """Write ``result`` as JSON to ``path``, stamped with its provenance, and record it."""
    stamp = provenance()
    result["provenance"] = stamp
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=indent) + "\n")
    record(path, stamp, manifest)
