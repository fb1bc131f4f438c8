"""Control plane at scale: the real supervisor loop against 2,048 simulated nodes x 8 ranks.

    python -m benchmarks.experiments.control_scale                  # 3 rows and a profile (~3 min)
    python -m benchmarks.experiments.control_scale --quick          # 256 nodes x 8: it works (~40 s)
    python -m benchmarks.experiments.control_scale --rows 1 --duration 600   # 10 min: false detections
    python -m benchmarks.experiments.control_scale --receive-path   # what one message costs (~1 min)

The supervisor process runs ``tp run``'s supervisor: the real ``Supervisor`` loop
(``supervisor/loop.py``), its ``ControlServer`` on 127.0.0.1, its ``Detectors`` and the
planner, for a job of N nodes x 8 ranks and N/128 spares. Only Slurm is simulated (steps
with no process, a slurmd probe answered from the simulation) and recoveries are planned
but not carried out: :mod:`.control_scale_supervisor`. A few load-generator processes play
the nodes' agents, one DEALER per node speaking the real signed protocol (a ``hello`` and
a ``live_ready`` per rank, then one heartbeat per node as ``rank/nodebeat.py`` sends it, or
one per rank): :mod:`.control_scale_agents`. Both sides share :mod:`.control_scale_world`.

The agents connect in waves, greet at a bounded rate and beat slower until every step is
up (:data:`~.control_scale_world.RAMP_RATE`); the server's gate admits all their handshakes
at once (``CountingServer`` says why the default budget of 256 cannot). Once every step is
up, a row measures a window without faults (``--duration``): the
supervisor process's CPU time over wall time (zmq's I/O thread and the gate's included)
and its loop thread's alone, the messages its polls returned per second and how old they
were. Then five faults strike five nodes, a few seconds apart: a dead agent whose step
ends (srun reports the exit), a stopped node (its agent stops sending, its slurmd stops
answering), a dead rank (its agent says its process is gone; its entry ages), a hung rank
(its entry ages, its process lives) and a dead agent (its socket closes; the node and its
step live on). The row says when the loop raised a fault on each node (from the fault, and
from its last beat), which detector, on what evidence, the plan, and every fault raised on
a node that was not struck, over the whole run (a false detection).

Rows: the job of ``--nodes`` (2,048) with per-node beats, the one issue 27 judges (under
5 % of a core, detection within 1 s, no false detection in 10 minutes); the same with an
eighth of the nodes; that smaller job with per-rank beats (as many messages a second as
the first row's); then the first row again for 15 s under cProfile (the loop thread's CPU
time), which says where its time goes. ``--receive-path`` measures instead what one
message costs the receiving thread, decoded or not, one by one or batched
(:mod:`.control_scale_receive`).

This is a script, not a test: numbers depend on the machine; never assert on them.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import resource
import secrets
import sys
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import zmq

from benchmarks import manifest

from .control_scale_agents import agents_main
from .control_scale_receive import costs_table, loop_costs, receive_path, receive_table
from .control_scale_supervisor import LAUNCH_TIMEOUT_S, TAIL_S, UP_TIMEOUT_S, supervisor_main
from .control_scale_world import (
    FaultKind,
    Injected,
    Row,
    Schedule,
    fault_plan,
    last_local_beat,
    node_name,
)

#: The budget issue 27 sets: a share of one core.
BUDGET = 0.05
#: Most nodes one load generator owns (each a TCP connection and a few descriptors).
NODES_PER_GENERATOR = 4096
#: The window starts this long after the nodes beat at the row's interval.
SETTLE_S = 3.0
#: Longest wait for a process of the benchmark to start, answer or finish.
PROCESS_TIMEOUT_S = 60.0
#: The first row's window by default (with --quick: its only row's), and the shortest one.
WINDOW_S = 30.0
QUICK_WINDOW_S = 20.0
MIN_WINDOW_S = 5.0
#: The smaller rows, and the profiled repeat, measure at most this long.
SMALL_WINDOW_S = 20.0
PROFILE_WINDOW_S = 15.0
#: Faults that need a node's agent: a job with per-rank beats has none.
AGENT_FAULTS = (FaultKind.AGENT_DIED, FaultKind.AGENT_STEP_ENDED)


@dataclass(frozen=True)
class Plan:
    """A row and how long it measures; ``profile``: cProfile the loop's thread in the window."""

    row: Row
    window_s: float
    profile: bool = False


def plans(nodes: int, window_s: float, *, quick: bool = False, profile: bool = True) -> list[Plan]:
    """The rows for ``nodes`` nodes: see the module docstring."""
    big = Row(f"{nodes:,} nodes x 8, per-node beats", nodes, spares=nodes // 128)
    if quick:
        return [Plan(big, window_s)]
    small = max(nodes // 8, 8)
    per_rank_faults = tuple(k for k in FaultKind if k not in AGENT_FAULTS)
    out = [
        Plan(big, window_s),
        Plan(
            Row(f"{small:,} nodes x 8, per-node beats", small, spares=small // 128),
            min(window_s, SMALL_WINDOW_S),
        ),
        Plan(
            Row(
                f"{small:,} nodes x 8, per-rank beats",
                small,
                spares=small // 128,
                per_node=False,
                faults=per_rank_faults,
            ),
            min(window_s, SMALL_WINDOW_S),
        ),
    ]
    if profile:
        out.append(
            Plan(replace(big, name=f"{big.name}, under cProfile", faults=()), PROFILE_WINDOW_S, profile=True)
        )
    return out


# --- one row ---------------------------------------------------------------------------------


def receive(conn: Connection, timeout_s: float, what: str) -> Any:
    """The next object on ``conn``, or SystemExit after ``timeout_s`` naming what did not come."""
    if not conn.poll(timeout_s):
        sys.exit(f"control_scale: no {what} within {timeout_s:g} s (a process died or hangs; see above)")
    try:
        return conn.recv()
    except (EOFError, ConnectionError):
        sys.exit(f"control_scale: the process that was to send {what} has died (its traceback is above)")


def generator_count(row: Row) -> int:
    return max(2, -(-(row.nodes + row.spares) // NODES_PER_GENERATOR))


def run_row(plan: Plan) -> dict[str, Any]:
    """One row: a supervisor process, its load generators, the schedule, the results."""
    row, ctx = plan.row, mp.get_context("spawn")
    secret = secrets.token_bytes(32)
    sup_conn, child = ctx.Pipe()
    procs = [ctx.Process(target=supervisor_main, args=(child, secret, row, plan.profile), daemon=True)]
    procs[0].start()
    try:
        endpoint = receive(sup_conn, PROCESS_TIMEOUT_S, "endpoint from the supervisor process")
        conns = []
        count = generator_count(row)
        for g in range(count):
            parent, child = ctx.Pipe()
            procs.append(
                ctx.Process(target=agents_main, args=(child, endpoint, secret, row, g, count), daemon=True)
            )
            procs[-1].start()
            conns.append(parent)
        for c in conns:
            receive(c, PROCESS_TIMEOUT_S, "ready from a load generator")  # sockets made, connecting
        sup_conn.send("run")
        receive(sup_conn, LAUNCH_TIMEOUT_S + PROCESS_TIMEOUT_S, "word that every step is launched")
        origin = time.monotonic() + 0.1
        for c in conns:
            c.send(origin)
        up = receive(sup_conn, UP_TIMEOUT_S + PROCESS_TIMEOUT_S, "word that every step is up")
        said = f"every step up {up['after_s']} s after launch"
        if not up["up"]:
            said = f"NOT every step up: {up['steps_up']} of {row.nodes + row.spares} after {up['after_s']} s"
        print(f"  {row.name}: {said}; measuring", flush=True)
        steady_from = time.monotonic() + 0.2
        start = steady_from + SETTLE_S
        end = start + plan.window_s
        schedule = Schedule(origin, steady_from, start, end, fault_plan(row, end))
        for c in conns:
            c.send(schedule)
        sup_conn.send(schedule)  # not every step up: measured all the same, and said so
        time.sleep(max(0.0, schedule.over + TAIL_S - time.monotonic()))
        for c in conns:
            c.send("end")
        gens = [receive(c, PROCESS_TIMEOUT_S, "a load generator's results") for c in conns]
        result = receive(sup_conn, PROCESS_TIMEOUT_S, "the supervisor's results")
        for proc in procs:
            proc.join(timeout=PROCESS_TIMEOUT_S)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
    return summarise(plan, up, schedule, result, gens)


# --- what a row says ---------------------------------------------------------------------------


def summarise(
    plan: Plan, up: dict[str, Any], schedule: Schedule, result: dict[str, Any], gens: list[dict[str, Any]]
) -> dict[str, Any]:
    """One row's JSON: the supervisor's numbers, each fault's detection, the generators' load."""
    row = plan.row
    last_sent: dict[int, float | None] = {}
    for g in gens:
        last_sent.update({int(k): v for k, v in g["last_sent"].items()})
    detections = detected(result.pop("plans"))
    faults = [
        fault_row(f, detections, schedule, row.interval_s, last_sent.get(f.node)) for f in schedule.faults
    ]
    struck = {node_name(f.node): f.at for f in schedule.faults}
    false = sorted({d["node"] for d in detections if d["at"] < struck.get(d["node"], float("inf"))})
    delays = sorted(result.pop("delays_s"))
    return {
        "row": asdict(row),
        "window_s": plan.window_s,
        "profiled": plan.profile,
        "ranks": row.ranks,
        "offered_rate": row.offered_rate,
        "up": up,
        **result,
        "delay_ms": {q: _ms(percentile(delays, p)) for q, p in (("p50", 0.5), ("p99", 0.99), ("max", 1.0))},
        "faults": faults,
        "false_detections": false,
        "generators": {
            "processes": len(gens),
            "cpu_share": sum(g["cpu_share"] for g in gens),
            "sent": sum(g["sent"] for g in gens),
            "refused": sum(g["refused"] for g in gens),
            "skipped": sum(g["skipped"] for g in gens),
            "max_lateness_s": max(g["lateness_s"] for g in gens),
        },
    }


def detected(plans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every fault the loop raised, with its plan's action and when (``time.monotonic``)."""
    return [{"at": p["at"], "action": p["action"], **f} for p in plans for f in p["faults"]]


def fault_row(
    fault: Injected, detections: list[dict[str, Any]], schedule: Schedule, interval: float, sent: float | None
) -> dict[str, Any]:
    """How one fault was found: the first detection on its node after it struck.

    Its last beat: the agent's last heartbeat sent (a stopped node, a dead agent), or the
    struck rank's last beat to its agent (a dead or hung rank), which its entry's age carries.
    """
    node = node_name(fault.node)
    if fault.kind in (FaultKind.RANK_DIED, FaultKind.RANK_HUNG):
        last = last_local_beat(fault.at, schedule.origin, fault.local, interval)
    else:
        last = sent
    found = next((d for d in detections if d["node"] == node and d["at"] >= fault.at), None)
    out: dict[str, Any] = {
        "kind": str(fault.kind),
        "node": node,
        "struck_s": round(fault.at - schedule.start, 2),
    }
    if found is None:
        return {**out, "found_s": None}
    return {
        **out,
        "found_s": round(found["at"] - fault.at, 3),
        "after_last_beat_s": None if last is None else round(found["at"] - last, 3),
        "detector": found["detector"],
        "evidence": found["evidence"],
        "plan": found["action"],
        "detail": found["detail"],
    }


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


# --- output --------------------------------------------------------------------------------------


COLUMNS = (
    "row",
    "msg/s sent",
    "msg/s taken",
    "supervisor CPU",
    "loop thread",
    "us/msg",
    "delay p50/p99 ms",
    *(str(k) for k in FaultKind),
    "false detections",
)


def row_cells(row: dict[str, Any]) -> list[str]:
    name = row["row"]["name"]
    if "cpu_share" not in row:
        return [name, f"{row['offered_rate']:,.0f}", "no window", *["-"] * (len(COLUMNS) - 3)]
    found = {f["kind"]: f for f in row["faults"]}
    cells = []
    for kind in FaultKind:
        f = found.get(str(kind))
        cells.append("-" if f is None else "missed" if f["found_s"] is None else f"{f['found_s']:.2f}")
    lat = row["delay_ms"]
    return [
        name,
        f"{row['offered_rate']:,.0f}",
        f"{row['rate']:,.0f}",
        f"{row['cpu_share']:.1%}",
        f"{row['main_thread_share']:.1%}",
        "-" if row["cpu_us_per_msg"] is None else f"{row['cpu_us_per_msg']:.1f}",
        f"{_num(lat['p50'])} / {_num(lat['p99'])}",
        *cells,
        f"{len(row['false_detections'])}",
    ]


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}" if value >= 10 else f"{value:.1f}"


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table (detections: seconds from the fault to the loop's fault)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row_cells(row)) + " |" for row in rows]
    return "\n".join(lines)


FAULT_COLUMNS = ("row", "fault", "found after (s)", "after its last beat (s)", "detector", "evidence", "plan")


def fault_table(rows: list[dict[str, Any]]) -> str:
    """How each fault was found, row by row."""
    lines = ["| " + " | ".join(FAULT_COLUMNS) + " |", "|" + "---|" * len(FAULT_COLUMNS)]
    for row in rows:
        for f in row["faults"]:
            if f["found_s"] is None:
                cells = [f["kind"], "missed", "-", "-", "-", "-"]
            else:
                last = "-" if f["after_last_beat_s"] is None else f"{f['after_last_beat_s']:.2f}"
                cells = [f["kind"], f"{f['found_s']:.2f}", last, f["detector"], f["evidence"], f["plan"]]
            lines.append("| " + " | ".join([row["row"]["name"], *cells]) + " |")
    return "\n".join(lines)


def progress_line(row: dict[str, Any]) -> str:
    """What one row's run looked like: the start, the generators' load, the loop."""
    gen, up = row["generators"], row["up"]
    started = f"every step up {up['after_s']} s after launch" if up["up"] else f"{up['steps_up']} steps up"
    return (
        f"  {row['row']['name']}: {row['seconds']:.0f} s; {started}; {gen['processes']} generators: "
        f"{gen['cpu_share']:.0%} of a core, {gen['refused']} sends refused, {gen['skipped']} beats skipped, "
        f"up to {gen['max_lateness_s']:.2f} s late; {row['rejected']:,} messages rejected; "
        f"connections refused: {row['refused_connections'] or 'none'}; "
        f"{row.get('polls_per_s', 0):,.0f} polls/s; {row['probes']} probes; "
        f"max RSS {row['max_rss_mb']:.0f} MB; "
        f"false detections: {', '.join(row['false_detections']) or 'none'}"
    )


def environment() -> dict[str, Any]:
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "zmq": f"libzmq {zmq.zmq_version()}, pyzmq {zmq.__version__}",
        "fd_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[1],
        "load_average": os.getloadavg(),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.experiments.control_scale", description=__doc__.splitlines()[0]
    )
    p.add_argument("--quick", action="store_true", help="one row of 256 nodes, 20 s: checks that it works")
    p.add_argument("--nodes", type=int, help="active nodes of 8 ranks (default 2048; 256 with --quick)")
    p.add_argument(
        "--duration",
        type=float,
        help=f"seconds the first row measures before its faults (default {WINDOW_S:g}; "
        f"{QUICK_WINDOW_S:g} with --quick; at least {MIN_WINDOW_S:g})",
    )
    p.add_argument("--rows", help="comma-separated row numbers to run (1-based), e.g. 1 or 1,3")
    p.add_argument("--no-profile", action="store_true", help="leave out the profiled repeat of row 1")
    p.add_argument(
        "--receive-path",
        action="store_true",
        help="instead of the rows: what one message costs the receiving thread, decoded or not, "
        "one by one or batched (control_scale_receive.py; ~1 min)",
    )
    p.add_argument(
        "--json",
        type=Path,
        help="write the results here (default: benchmarks/results/control-loop-scale-DATE.json; "
        "none with --quick)",
    )
    args = p.parse_args(argv)
    if args.duration is not None and args.duration < MIN_WINDOW_S:
        p.error(f"--duration must be at least {MIN_WINDOW_S:g} s")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    nodes = args.nodes or (256 if args.quick else 2048)
    window = args.duration or (QUICK_WINDOW_S if args.quick else WINDOW_S)
    todo = plans(nodes, window, quick=args.quick, profile=not args.no_profile)
    if args.rows:
        todo = [todo[int(k) - 1] for k in args.rows.split(",")]
    env = environment()
    print(f"control plane at scale (the real loop), {env['date']} on {env['host']} ({env['cpus']} CPUs)")
    print(env["zmq"])
    print(f"the host's load average (1, 5, 15 min) at the start: {env['load_average']}", flush=True)
    name = "control-loop-scale-receive" if args.receive_path else "control-loop-scale"
    path = args.json or (None if args.quick else manifest.RESULTS / f"{name}-{env['date'][:10]}.json")
    result: dict[str, Any] = {"environment": env, "budget": BUDGET, "rows": [], "profiles": []}
    if args.receive_path:
        small = Row(f"{max(nodes // 8, 8):,} nodes x 8, per-node beats", max(nodes // 8, 8))
        if args.quick:
            small = replace(small, name=f"{nodes:,} nodes x 8, per-node beats", nodes=nodes)
        result["receive_path"] = receive_path(small)
        print(receive_table(small, result["receive_path"]))
        costs = {n: loop_costs(n) for n in sorted({small.nodes, nodes})}
        result["loop_costs"] = {str(n): c for n, c in costs.items()}
        print()
        print(costs_table(costs))
    for plan in [] if args.receive_path else todo:
        began = time.monotonic()
        row = run_row(plan)
        row["seconds"] = round(time.monotonic() - began, 1)
        if "profile" in row:
            result["profiles"].append(strip_paths(f"{row['row']['name']}:\n{row.pop('profile')}"))
        result["rows"].append(row)
        print(progress_line(row))
        print(table([row]).splitlines()[-1], flush=True)
        if path is not None:  # after every row: a run cut short keeps what it measured
            manifest.write_result(path, result)
    if result["rows"]:
        print()
        print(table(result["rows"]))
        print()
        print(fault_table(result["rows"]))
    for text in result["profiles"]:
        print()
        print(text)
    result["environment"]["load_average_at_end"] = os.getloadavg()
    print(f"the host's load average at the end: {os.getloadavg()}")
    if path is not None:
        manifest.write_result(path, result)
        print(f"wrote {path}")
    return 0


def strip_paths(profile: str) -> str:
    """A profile's text with this checkout's and Python's folders left out of the file names."""
    root = str(manifest.ROOT) + os.sep
    text = profile.replace(root, "")
    return text.replace(os.path.dirname(os.__file__) + os.sep, "")


if __name__ == "__main__":
    sys.exit(main())
