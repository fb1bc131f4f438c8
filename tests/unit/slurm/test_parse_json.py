"""Parsing recorded ``sinfo --json`` / ``squeue --json`` of Slurm 22.05 and 24.11, and broken JSON."""

from __future__ import annotations

import json

import pytest

from torchpass_slurm.errors import SlurmError, SlurmParseError
from torchpass_slurm.slurm.models import Job, Node
from torchpass_slurm.slurm.parse import (
    number,
    parse_job_id,
    parse_sinfo_json,
    parse_squeue_json,
    parse_version,
    split_state,
)

from .conftest import VERSIONS, fixture_text

D = frozenset({"DRAIN"})


def summary(nodes: tuple[Node, ...]) -> list[tuple[str, str, str | None]]:
    return [(n.name, n.state_text, n.reason) for n in nodes]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("sinfo_idle.json", [("n1", "IDLE", None), ("n2", "IDLE", None)]),
        ("sinfo_mixed.json", [("n1", "MIXED", None), ("n2", "MIXED", None)]),
        (
            "sinfo_mixed_drain.json",
            [("n1", "MIXED", None), ("n2", "MIXED+DRAIN", "tp: planned maintenance")],
        ),
        (
            "sinfo_drained.json",
            [("n1", "MIXED", None), ("n2", "IDLE+DRAIN", "tp: planned maintenance")],
        ),
        ("sinfo_down.json", [("n1", "MIXED", None), ("n2", "DOWN+DRAIN", "tp: test down")]),
    ],
)
def test_sinfo_states(version: str, name: str, expected: list[tuple[str, str, str | None]]) -> None:
    nodes = parse_sinfo_json(fixture_text(version, name))
    assert sorted(summary(nodes)) == expected
    assert all(n.partitions == ("debug",) and n.cpus == 2 for n in nodes)


@pytest.mark.parametrize("version", VERSIONS)
def test_sinfo_not_responding(version: str) -> None:
    nodes = {n.name: n for n in parse_sinfo_json(fixture_text(version, "sinfo_not_responding.json"))}
    n2 = nodes["n2"]
    assert (n2.state, n2.flags) == ("IDLE", frozenset({"NOT_RESPONDING"}))
    assert not n2.is_responding and not n2.is_usable
    # 22.05 drops the old reason once the node was resumed; 24.11 keeps it.
    assert n2.reason == {"22.05": None, "24.11": "tp: test down"}[version]
    assert nodes["n1"].is_responding and nodes["n1"].is_usable


@pytest.mark.parametrize("version", VERSIONS)
def test_node_helpers_on_real_drain_states(version: str) -> None:
    draining = {n.name: n for n in parse_sinfo_json(fixture_text(version, "sinfo_mixed_drain.json"))}
    drained = {n.name: n for n in parse_sinfo_json(fixture_text(version, "sinfo_drained.json"))}
    down = {n.name: n for n in parse_sinfo_json(fixture_text(version, "sinfo_down.json"))}
    assert draining["n2"].is_drain and draining["n2"].is_draining and not draining["n2"].is_drained
    assert drained["n2"].is_drained and not drained["n2"].is_draining
    assert down["n2"].is_down and down["n2"].is_drained
    assert not draining["n1"].is_drain and draining["n1"].is_usable


@pytest.mark.parametrize("version", VERSIONS)
def test_squeue_running_job(version: str) -> None:
    (job,) = parse_squeue_json(fixture_text(version, "squeue_running.json"))
    assert job == Job(
        job_id=1,
        name="tpfix-job",
        state="RUNNING",
        nodes=("n1", "n2"),
        batch_host="n1",
        partition="debug",
        reason=None,
        num_nodes=2,
        std_out=None if version == "22.05" else "//slurm-1.out",  # 22.05 leaves it empty
        work_dir="/",
    )
    assert job.is_running and not job.is_pending and not job.is_finished


@pytest.mark.parametrize("version", VERSIONS)
def test_squeue_after_shrink_shows_current_nodes(version: str) -> None:
    (job,) = parse_squeue_json(fixture_text(version, "squeue_shrunk.json"))
    assert (job.job_id, job.nodes, job.num_nodes) == (1, ("n1",), 1)


@pytest.mark.parametrize("version", VERSIONS)
def test_squeue_pending_job_has_no_nodes(version: str) -> None:
    running, pending = parse_squeue_json(fixture_text(version, "squeue_pending.json"))
    assert running.job_id == 1
    assert pending == Job(
        job_id=2,
        name="tpfix-pending",
        state="PENDING",
        nodes=(),
        batch_host=None,
        partition="debug",
        reason="Resources",
        num_nodes=2,
        std_out=None if version == "22.05" else "//slurm-2.out",
        work_dir="/",
    )


@pytest.mark.parametrize("version", VERSIONS)
def test_squeue_empty(version: str) -> None:
    assert parse_squeue_json(fixture_text(version, "squeue_empty.json")) == ()


@pytest.mark.parametrize(("version", "text"), [("22.05", "22.05.8"), ("24.11", "24.11.5")])
def test_version(version: str, text: str) -> None:
    parsed = parse_version(fixture_text(version, "sinfo_version.txt"))
    assert str(parsed) == text
    assert parsed.major_minor == version


@pytest.mark.parametrize("version", VERSIONS)
def test_sbatch_parsable(version: str) -> None:
    assert parse_job_id(fixture_text(version, "sbatch_parsable.txt")) == 1
    assert parse_job_id("42;cluster\n") == 42


def test_node_in_two_partitions_gets_both() -> None:
    doc = json.loads(fixture_text("24.11", "sinfo_idle.json"))
    extra = json.loads(json.dumps(doc["sinfo"][0]))
    extra["partition"]["name"] = "long"
    doc["sinfo"].append(extra)
    nodes = parse_sinfo_json(json.dumps(doc))
    assert [n.partitions for n in nodes] == [("debug", "long"), ("debug", "long")]


def test_scontrol_json_shape_with_list_states() -> None:
    doc = {"nodes": [{"name": "n1", "state": ["MIXED", "DRAIN"], "reason": "r", "cpus": 4}]}
    (node,) = parse_sinfo_json(json.dumps(doc))
    assert (node.state, node.flags, node.reason, node.cpus) == ("MIXED", D, "r", 4)


# --- malformed output --------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "detail"),
    [
        ("sinfo: error: slurm_load_node: Unable to contact slurm controller", "not JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"meta": {}}', "neither 'sinfo' nor 'nodes' is a key"),
        ('{"nodes": {"n1": {}}}', "'nodes' should be list, got dict"),
        ('{"nodes": [{"state": "idle"}]}', "missing key 'name'"),
        ('{"nodes": [{"name": "n1", "state": 3}]}', "'state' should be str/list, got int"),
        ('{"nodes": [{"name": "n1", "state": ""}]}', "the state is empty"),
        ('{"sinfo": [{"node": {"state": ["IDLE"]}}]}', "missing key 'nodes'"),
        ('{"nodes": [{"name": "n1", "state": "idle", "cpus": "2"}]}', "expected an integer, got '2'"),
    ],
)
def test_sinfo_malformed(text: str, detail: str) -> None:
    with pytest.raises(SlurmParseError) as info:
        parse_sinfo_json(text)
    assert detail in info.value.detail
    assert info.value.exit_code == 3


def test_parse_error_quotes_an_excerpt() -> None:
    with pytest.raises(SlurmParseError) as info:
        parse_sinfo_json("sinfo: error: Unable to contact slurm controller")
    assert info.value.message == (
        "could not parse sinfo --json output: not JSON (Expecting value at line 1) "
        "(output began: 'sinfo: error: Unable to contact slurm controller')"
    )


@pytest.mark.parametrize(
    ("text", "detail"),
    [
        ("", "not JSON"),
        ('{"jobs": null}', "'jobs' should be list, got NoneType"),
        ('{"jobs": [{"job_id": 1, "job_state": "RUNNING"}]}', "missing key 'nodes'"),
        ('{"jobs": [{"job_id": "1", "job_state": "RUNNING", "nodes": ""}]}', "'job_id' should be"),
        ('{"jobs": [{"job_id": 1, "job_state": ["RUNNING"], "nodes": "n[1-"}]}', "bad node list"),
        (
            '{"jobs": [{"job_id": {"set": false, "number": 0}, "job_state": "R", "nodes": ""}]}',
            "a job has no job_id",
        ),
    ],
)
def test_squeue_malformed(text: str, detail: str) -> None:
    with pytest.raises(SlurmParseError) as info:
        parse_squeue_json(text)
    assert detail in info.value.detail


def test_errors_reported_inside_the_json_are_raised() -> None:
    doc = {"jobs": [], "errors": [{"description": "Unable to contact slurm controller", "error_number": 1}]}
    with pytest.raises(SlurmError) as info:
        parse_squeue_json(json.dumps(doc))
    assert info.value.message == ("squeue --json output reported errors: Unable to contact slurm controller")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (5, 5),
        (None, None),
        ({"set": True, "infinite": False, "number": 7}, 7),
        ({"set": False, "infinite": False, "number": 0}, None),
        ({"set": True, "infinite": True, "number": 0}, None),
    ],
)
def test_number(value: object, expected: int | None) -> None:
    assert number(value) == expected


def test_number_rejects_bool() -> None:
    with pytest.raises(SlurmParseError):
        number(True)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("idle", ("IDLE", frozenset())),
        ("MIXED+DRAIN", ("MIXED", D)),
        (["DRAIN", "IDLE"], ("IDLE", D)),
        (["COMPLETING"], ("COMPLETING", frozenset())),
    ],
)
def test_split_state(value: object, expected: tuple[str, frozenset[str]]) -> None:
    assert split_state(value) == expected


@pytest.mark.parametrize("text", ["", "slurm", "slurm x.y", "sinfo 24.11.5"])
def test_bad_version(text: str) -> None:
    with pytest.raises(SlurmParseError):
        parse_version(text)


@pytest.mark.parametrize("text", ["", "Submitted batch job 5", "x;y"])
def test_bad_job_id(text: str) -> None:
    with pytest.raises(SlurmParseError):
        parse_job_id(text)
