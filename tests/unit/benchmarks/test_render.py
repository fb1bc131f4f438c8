"""benchmarks/render.py: the suite's JSON into markdown tables, the doc's generated part, PNGs.

The results here are written by hand in the suite's format (the suite itself
runs on the real cluster: ``scripts/bench``); these tests pin how they render.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks import render


def phases(detection: float | None, first_step: float) -> dict[str, float | None]:
    return {
        "detection": detection,
        "decision": 0.5,
        "rebuild": 0.1,
        "agreement": 0.0,
        "transfer": 0.2,
        "first_step": first_step,
        "total": 0.8 + first_step,
    }


def tp_run(seconds: float, faults: list[dict[str, Any]], injected: int) -> dict[str, Any]:
    return {
        "job": "7",
        "state": "COMPLETED",
        "seconds": seconds,
        "faults": faults,
        "injected": [{"kind": "kill", "node": "c2"}] * injected,
        "params_sha256": "ab",
    }


def fault(
    resolution: str, lost: int | None, recomputed: int | None, detection: float | None = 10.0
) -> dict[str, Any]:
    return {
        "resolution": resolution,
        "lost_steps": lost,
        "recomputed_steps": recomputed,
        "phases": phases(detection, 0.6),
    }


RESULTS: dict[str, Any] = {
    "environment": {"date": "2026-11-30T12:00:00+00:00", "host": "box", "cpus": 2, "sizing": "default"},
    "overhead": {
        "runs": {
            "plain": [{"tokens_per_s": 1000.0}, {"tokens_per_s": 1100.0}],
            "tp": [
                {"tokens_per_s": 950.0},  # a run from before the supervisor logged its CPU
                {"tokens_per_s": 1045.0, "supervisor_core_percent": 1.25, "srun_core_percent": 0.4},
            ],
        },
        "median_tokens_per_s": {"plain": 1050.0, "tp": 997.5},
        "overhead_percent": 5.0,
        "median_supervisor_core_percent": 1.25,
        "same_final_loss": True,
        "bitwise_equal_within_mode": {"plain": True, "tp": True},
    },
    "recovery": {
        "no_fault": tp_run(40.0, [], 0),
        "unplanned": tp_run(52.5, [fault("live", 0, 1)], 1),
        "planned": tp_run(41.0, [fault("live", 0, 0, detection=None)], 1),
    },
    "completion": {
        "fault_steps": [30, 70],
        "no_fault": tp_run(60.0, [], 0),
        "live": tp_run(80.0, [fault("live", 0, 1), fault("live", 0, 1)], 2),
        "restart": tp_run(95.0, [fault("checkpoint", 10, 10), fault("checkpoint", None, None)], 2),
        "requeue": {
            "job": "9",
            "state": "COMPLETED",
            "seconds": 230.0,
            "injected": [{}, {}],
            "starts_at_steps": [0, 20, 60],
            "requeues": 2,
            "steps_computed": 120,
            "recomputed_steps": 20,
        },
    },
    "transfer": {
        "results": [
            {"method": "raw-tcp", "size_mb": 10, "seconds": 0.01, "mb_per_s": 1000.0},
            {"method": "raw-tcp", "size_mb": 2000, "seconds": 1.6, "mb_per_s": 1250.0},
            {"method": "torch+stream", "size_mb": 10, "seconds": 0.02, "mb_per_s": 500.0},
            {"method": "torch+stream", "size_mb": 2000, "seconds": 2.0, "mb_per_s": 1000.0},
        ]
    },
}


def rows_of(lines: list[str]) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines if line.startswith("|")]


def test_overhead_table_has_each_run_the_median_and_the_loss() -> None:
    rows = rows_of(render.overhead_table(RESULTS["overhead"]))
    assert rows[2] == ["run 1", "1000", "950", "+5.0 %", "-", "-"]
    assert rows[3] == ["run 2", "1100", "1045", "+5.0 %", "1.25 %", "0.40 %"]
    assert rows[4] == ["**median**", "**1050**", "**998**", "**+5.0 %**", "1.25 %", ""]
    assert "Final loss the same in every run" in render.overhead_table(RESULTS["overhead"])[-1]


def test_recovery_table_splits_each_fault_and_compares_with_the_fault_free_run() -> None:
    rows = rows_of(render.recovery_table(RESULTS["recovery"]))
    assert rows[0][:4] == ["fault", "job time (s)", "over no fault (s)", "resolution"]
    assert rows[2][0] == "no fault"
    assert rows[3] == [
        "unplanned",
        "52.5",
        "+12.5",
        "live",
        "10.00",
        "0.50",
        "0.10",
        "0.00",
        "0.20",
        "0.60",
        "1.40",
        "0",
        "1",
    ]
    assert rows[4][:5] == ["planned", "41.0", "+1.0", "live", "-"]  # nothing to detect: no number
    assert len(rows) == 5  # no pre-emptive run in these results: no row


def test_completion_sums_steps_per_run_and_unknown_stays_unknown() -> None:
    rows = {r["key"]: r for r in render.completion_rows(RESULTS["completion"])}
    assert (rows["live"]["lost"], rows["live"]["recomputed"], rows["live"]["excess"]) == (0, 2, 20.0)
    assert rows["restart"]["lost"] is None  # one recovery's loss is unknown: the sum is too
    assert (rows["requeue"]["lost"], rows["requeue"]["recomputed"]) == (20, 20)
    text = "\n".join(render.completion_table(RESULTS["completion"]))
    assert (
        "| sbatch --requeue + periodic checkpoints (plain DDP) | 2 | COMPLETED | 230.0 | +170.0 | 20 | 20 |"
        in text
    )
    assert "started 3 times, at steps 0, 20, 60" in text


def test_job_time_runs_from_the_first_start_so_the_queue_wait_before_it_does_not_count() -> None:
    run = {
        "seconds": 100.0,
        "timeline": [
            [0.1, "PENDING"],
            [4.0, "RUNNING"],
            [50.0, "PENDING"],
            [60.0, "RUNNING"],
            [100.0, "COMPLETED"],
        ],
    }
    assert render.job_seconds(run) == 96.0  # the wait after a requeue (50-60 s) counts
    assert render.job_seconds({"seconds": 30.0}) == 30.0


def test_transfer_table_gives_each_method_by_size_and_the_ratio_to_raw_tcp() -> None:
    rows = rows_of(render.transfer_table(RESULTS["transfer"]))
    assert rows[0] == ["MB/s", "10 MB", "2 GB"]
    assert rows[2] == ["raw TCP (baseline)", "1000", "1250"]
    assert rows[3] == ["torch (gloo) + stream: live migration (auto)", "500", "1000"]
    assert rows[4] == ["torch + stream / raw TCP", "50%", "80%"]
    assert rows[5] == ["torch + stream: seconds", "0.020", "2.000"]


def test_update_doc_replaces_only_the_generated_part() -> None:
    doc = f"# Benchmarks\nintro\n{render.BEGIN}\nold table\n{render.END}\nafter\n"
    out = render.update_doc(doc, "new table\n")
    assert out == f"# Benchmarks\nintro\n{render.BEGIN}\nnew table\n{render.END}\nafter\n"
    assert render.update_doc(out, "new table\n") == out


def test_update_doc_without_markers_says_so() -> None:
    with pytest.raises(ValueError, match="no generated part"):
        render.update_doc("# Benchmarks\n", "x")


def test_the_real_doc_has_the_markers() -> None:
    text = render.DOC.read_text()
    assert text.count(render.BEGIN) == 1 and text.count(render.END) == 1


def test_render_writes_the_tables_into_the_doc_and_one_png_per_section(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"before\n{render.BEGIN}\n{render.END}\n")
    printed = render.render(RESULTS, doc=doc, img_dir=tmp_path / "img")
    assert printed in doc.read_text()
    assert "### Job completion time with node failures" in printed
    for name in ("bench-overhead.png", "bench-recovery.png", "bench-completion.png", "bench-transfer.png"):
        data = (tmp_path / "img" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
