"""benchmarks/peers_hsdp.py's pure parts: the runs' arguments, the torchft victim, the summaries."""

from __future__ import annotations

import pytest

from benchmarks import jobs, peers_hsdp


def test_the_runs_are_the_peers_quick_runs_on_the_2x2_mesh_with_one_node_lost_and_one_spare() -> None:
    size = peers_hsdp.HsdpSizing()
    assert (size.steps, size.step_sleep, size.model) == (24, 0.3, (128, 2))
    assert (size.kills_at, size.spares) == ((8,), 1)
    args = size.train_args(size.steps, size.step_sleep, size.ckpt_every)
    assert args[-2:] == ["--mesh", "2x2"]
    assert args[:4] == ["--d-model", "128", "--n-layers", "2"]


def start(group: int, rank: int, node: str, restart: int = 0) -> dict:
    return {"t": 1.0, "group": group, "restart": restart, "event": "start", "rank": rank, "node": node}


def test_the_torchft_victim_is_a_rank_of_the_last_group_away_from_the_batch_host() -> None:
    records = [
        start(0, 0, "c1"),
        start(0, 1, "c2"),
        start(1, 0, "c3"),
        start(1, 1, "c4"),
        {"t": 2.0, "group": 1, "restart": 0, "step": 3, "quorum": 1, "participants": 2},
    ]
    assert peers_hsdp.torchft_victim_of(records, {"c1"}) == "c4"
    assert peers_hsdp.torchft_victim_of(records, {"c1", "c4"}) == "c3"


def test_a_restarted_group_is_found_where_it_started_last() -> None:
    records = [
        start(0, 0, "c1"),
        start(0, 1, "c2"),
        start(1, 0, "c3"),
        start(1, 1, "c4"),
        start(1, 0, "c3", restart=1),
        start(1, 1, "c5", restart=1),
    ]
    assert peers_hsdp.torchft_victim_of(records, {"c1", "c4"}) == "c5"


def test_no_rank_outside_the_batch_host_is_a_bench_error_that_says_so() -> None:
    with pytest.raises(jobs.BenchError, match="no rank outside its batch host"):
        peers_hsdp.torchft_victim_of([start(0, 0, "c1")], {"c1"})


def test_the_throughput_summary_takes_medians_and_torchpass_over_torchft() -> None:
    out = peers_hsdp.throughput_summary({"torchpass": [3000.0, 5000.0, 4000.0], "torchft": [2000.0, 2000.0]})
    assert out["median_tokens_per_s"] == {"torchpass": 4000.0, "torchft": 2000.0}
    assert out["torchpass_over_torchft"] == 2.0
    alone = peers_hsdp.throughput_summary({"torchpass": [1.0], "torchft": []})
    assert alone["torchpass_over_torchft"] is None


def run(state: str, seconds: float, **fields: object) -> dict:
    return {
        "state": state,
        "seconds": seconds,
        "timeline": [[1.0, "PENDING"], [2.0, "RUNNING"]],
        "bitwise_equal_to_no_fault": False,
        **fields,
    }


def test_the_tables_give_every_run_its_row_and_a_loss_as_a_loss() -> None:
    result = {
        "throughput": peers_hsdp.throughput_summary(
            {"torchpass": [4000.0, 4200.0], "torchft": [3000.0, 3100.0]}
        ),
        "systems": {
            "torchpass": {
                "no_fault": run(
                    "COMPLETED", 40.0, final_loss="3.4000", lost_steps=0, bitwise_equal_to_no_fault=True
                ),
                "node_kill": run(
                    "COMPLETED",
                    43.5,
                    recoveries_s=[1.5],
                    lost_steps=0,
                    final_loss="3.4000",
                    bitwise_equal_to_no_fault=True,
                ),
            },
            "torchft": {
                "no_fault": run(
                    "COMPLETED",
                    45.0,
                    final_loss="3.5000",
                    lost_steps=0,
                    fewer_replica_steps=0,
                    bitwise_equal_to_no_fault=True,
                ),
                "node_kill": run(
                    "COMPLETED",
                    52.0,
                    recoveries_s=[5.2],
                    full_strength_s=[None],
                    lost_steps=0,
                    fewer_replica_steps=16,
                    final_loss="3.9000",
                ),
            },
        },
    }
    text = peers_hsdp.tables(result)
    assert "| torchpass HSDP 2x2 (live migration, 1 hot spare) | 4,000 | 4,200 | 4,100 |" in text
    assert "torchpass / torchft: 1.344" in text
    assert (
        "| torchpass HSDP 2x2 (live migration, 1 hot spare) | a node powered off | COMPLETED "
        "| 41.5 | +3.5 | 1.50 | - | 0 | - | 3.4000 | yes |"
    ) in text
    assert (
        "| torchft 0.2.0 HSDP 2x2 (TorchTitan's wiring, 1 idle node) | a node powered off | COMPLETED "
        "| 50.0 | +7.0 | 5.20 | - | 0 | 16 | 3.9000 | no |"
    ) in text


def test_unknown_cases_are_refused_with_the_valid_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        peers_hsdp.parse_args(["--cases", "no_fault,drain"])
    assert exit_info.value.code == 2
    assert "--cases: unknown drain; valid: no_fault, node_kill, rank_kill" in capsys.readouterr().err
