#!/usr/bin/env python3
"""What torchpass costs a rank between its steps: CPU time per second of wall time.

    python3 -m benchmarks.experiments.idle_cost [--seconds S] [--json F]

Three processes, one after the other, each for ``--seconds`` against a real ControlServer
(CURVE, ZeroMQ on 127.0.0.1) that this process serves:

- ``baseline``: a Python process that imported torch and sleeps: what any rank costs;
- ``spare``: a hot spare in standby (``runtime.init`` with the spare role): its wait for a
  promotion and its heartbeats;
- ``active``: an active rank's runtime whose training thread sleeps: the heartbeat thread
  alone (heartbeats, the outbox, incoming messages).

The cost of each is its CPU seconds (user + system, from /proc) per wall second, less the
baseline's; printed in % of one core. A training step here is CPU-bound, so on a saturated
host every % of a core a rank's side threads take is a % of its throughput. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from torchpass_slurm.control.secret import create_secret, load_secret
from torchpass_slurm.control.server import ControlServer

CHILD = textwrap.dedent("""
    import os, sys, time, datetime
    import torch  # every rank has it
    role, seconds = sys.argv[1], float(sys.argv[2])
    if role == "baseline":
        print("ready", flush=True)
        time.sleep(seconds)
        sys.exit(0)
    from torchpass_slurm.rank import runtime
    env = dict(os.environ)
    if role == "spare":
        print("ready", flush=True)
        try:
            runtime.init(env, standby_timeout=datetime.timedelta(seconds=seconds))
        except Exception:
            pass  # the standby timeout: the measurement is over
        sys.exit(0)
    rt = runtime.init(env)
    print("ready", flush=True)
    for step in range(int(seconds * 10)):
        rt.report_step(step)
        time.sleep(0.1)
    rt.close()
""")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(role: str, seconds: float, server: ControlServer, secret_file: Path) -> dict[str, Any]:
    env = dict(
        os.environ,
        TORCHPASS_CONTROL=server.endpoint,
        TORCHPASS_SECRET_FILE=str(secret_file),
        TORCHPASS_ROLE=role if role != "baseline" else "active",
        TORCHPASS_NODE="c9",
        TORCHPASS_JOB_ID="1",
        SLURM_LOCALID="0",
        TORCHPASS_RANK_BASE="0",
        WORLD_SIZE="1",
        SLURM_PROCID="0",
        SLURM_NTASKS="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29999",
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, role, str(seconds + 2)], env=env, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the {role} process did not start")
    messages = 0
    deadline = time.monotonic() + 1.0  # settle: imports done, first messages through
    while time.monotonic() < deadline:
        messages += len(server.poll(timedelta(milliseconds=50)))
    start_cpu, start = cpu_seconds(proc.pid), time.monotonic()
    counted = 0
    while time.monotonic() - start < seconds:
        counted += len(server.poll(timedelta(milliseconds=50)))
    cpu, wall = cpu_seconds(proc.pid) - start_cpu, time.monotonic() - start
    proc.kill()
    proc.wait(timeout=30)
    return {
        "role": role,
        "cpu_s": round(cpu, 3),
        "wall_s": round(wall, 3),
        "core_share": cpu / wall,
        "messages_per_s": round(counted / wall, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python3 -m benchmarks.experiments.idle_cost", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--seconds", type=float, default=20.0, help="measured seconds per process (default 20)")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        secret_file = create_secret(Path(tmp))
        with ControlServer(load_secret(secret_file), "127.0.0.1") as server:
            rows = [
                measure(role, args.seconds, server, secret_file) for role in ("baseline", "spare", "active")
            ]
    base = rows[0]["core_share"]
    print(
        f"{'process':<10} {'CPU s':>7} {'wall s':>7} {'% of a core':>12} {'less baseline':>14} {'msg/s':>7}"
    )
    for r in rows:
        r["cost_share"] = r["core_share"] - base
        print(
            f"{r['role']:<10} {r['cpu_s']:>7.3f} {r['wall_s']:>7.2f} {100 * r['core_share']:>11.2f}% "
            f"{100 * r['cost_share']:>13.2f}% {r['messages_per_s']:>7.1f}"
        )
    if args.json:
        args.json.write_text(json.dumps({"seconds": args.seconds, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
