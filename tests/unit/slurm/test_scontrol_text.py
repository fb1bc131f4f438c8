"""Parsing recorded ``scontrol -o show job`` / ``show node`` text, and broken text."""

from __future__ import annotations

from datetime import datetime

import pytest

from torchpass_slurm.errors import SlurmParseError
from torchpass_slurm.slurm.models import Job
from torchpass_slurm.slurm.scontrol_text import parse_records, parse_scontrol_job, parse_scontrol_nodes

from .conftest import VERSIONS, fixture_text


@pytest.mark.parametrize("version", VERSIONS)
def test_running_job(version: str) -> None:
    job = parse_scontrol_job(fixture_text(version, "scontrol_show_job_running.txt"))
    assert job == Job(
        job_id=1,
        name="tpfix-job",
        state="RUNNING",
        nodes=("n1", "n2"),
        batch_host="n1",
        partition="debug",
        reason=None,
        num_nodes=2,
        comment=None,
        std_out="//slurm-1.out",
        work_dir="/",
    )


@pytest.mark.parametrize("version", VERSIONS)
def test_comment_written_by_tp_submit(version: str) -> None:
    # The recorded job had no --comment; scontrol then prints Comment= after WorkDir=.
    text = fixture_text(version, "scontrol_show_job_running.txt").replace(
        "WorkDir=/ ", "WorkDir=/home/u Comment=torchpass:run_dir=/shared/my runs/r1 "
    )
    job = parse_scontrol_job(text)
    assert (job.comment, job.work_dir, job.std_out) == (
        "torchpass:run_dir=/shared/my runs/r1",
        "/home/u",
        "//slurm-1.out",
    )


@pytest.mark.parametrize("version", VERSIONS)
def test_shrunk_job_reports_current_node_list(version: str) -> None:
    job = parse_scontrol_job(fixture_text(version, "scontrol_show_job_shrunk.txt"))
    assert (job.nodes, job.num_nodes, job.batch_host) == (("n1",), 1, "n1")


@pytest.mark.parametrize("version", VERSIONS)
def test_idle_nodes(version: str) -> None:
    nodes = parse_scontrol_nodes(fixture_text(version, "scontrol_show_node_idle.txt"))
    assert [(n.name, n.state_text, n.reason, n.partitions, n.cpus) for n in nodes] == [
        ("n1", "IDLE", None, ("debug",), 2),
        ("n2", "IDLE", None, ("debug",), 2),
    ]


@pytest.mark.parametrize("version", VERSIONS)
def test_when_slurmd_started_is_read_as_local_time(version: str) -> None:
    started = {"22.05": "2026-11-30T08:42:32", "24.11": "2026-11-30T08:45:14"}[version]
    nodes = parse_scontrol_nodes(fixture_text(version, "scontrol_show_node_idle.txt"))
    assert [n.slurmd_started for n in nodes] == [datetime.fromisoformat(started).timestamp()] * 2


@pytest.mark.parametrize("value", ["None", "Unknown", "(null)", "yesterday"])
def test_a_slurmd_start_slurm_does_not_give_is_none(value: str) -> None:
    text = fixture_text("24.11", "scontrol_show_node_idle.txt").splitlines()[0]
    text = text.replace("SlurmdStartTime=2026-11-30T08:45:14", f"SlurmdStartTime={value}")
    (node,) = parse_scontrol_nodes(text)
    assert node.slurmd_started is None and node.state == "IDLE"


@pytest.mark.parametrize("version", VERSIONS)
def test_draining_node_reason_without_user_and_time(version: str) -> None:
    (node,) = parse_scontrol_nodes(fixture_text(version, "scontrol_show_node_mixed_drain.txt"))
    assert (node.state_text, node.reason) == ("MIXED+DRAIN", "tp: planned maintenance")
    assert node.is_draining


@pytest.mark.parametrize("version", VERSIONS)
def test_not_responding_node(version: str) -> None:
    (node,) = parse_scontrol_nodes(fixture_text(version, "scontrol_show_node_not_responding.txt"))
    assert node.state_text == "IDLE+NOT_RESPONDING"
    assert not node.is_responding


def test_values_with_blanks_continue_the_previous_key() -> None:
    (rec,) = parse_records("NodeName=n1 OS=Linux 6.1 #1 SMP State=IDLE", tail_key="Reason")
    assert rec == {"NodeName": "n1", "OS": "Linux 6.1 #1 SMP", "State": "IDLE"}


def test_reason_runs_to_end_of_node_line() -> None:
    (node,) = parse_scontrol_nodes(
        "NodeName=n1 State=DOWN* Reason=disk a=b failed [root@2024-01-01T00:00:00]"
    )
    assert node.reason == "disk a=b failed"
    assert node.state_text == "DOWN+NOT_RESPONDING"


@pytest.mark.parametrize(
    ("text", "detail"),
    [
        ("", "expected one job, got 0"),
        ("JobId=1 JobState=RUNNING\nJobId=2 JobState=RUNNING", "expected one job, got 2"),
        ("JobName=x JobState=RUNNING NodeList=n1", "missing JobId="),
        ("JobId=abc JobState=RUNNING NodeList=n1", "JobId='abc' is not a number"),
        ("JobId=1 JobState=RUNNING NodeList=n[1-", "bad node list"),
        ("slurm_load_jobs error: Invalid job id specified", "expected Key=value"),
    ],
)
def test_malformed_job(text: str, detail: str) -> None:
    with pytest.raises(SlurmParseError) as info:
        parse_scontrol_job(text)
    assert detail in info.value.detail


def test_malformed_node() -> None:
    with pytest.raises(SlurmParseError) as info:
        parse_scontrol_nodes("NodeName=n1 CPUTot=2")
    assert info.value.detail == "missing State="


def test_a_heterogeneous_job_is_its_leader() -> None:
    """``scontrol -o show job LEADER`` of tp-submit's heterogeneous job (recorded on 24.11.5) lists
    both components; the leader's id names component 0, the supervisor's (s1)."""
    job = parse_scontrol_job(fixture_text("24.11", "scontrol_show_job_hetjob.txt"))
    assert (job.job_id, job.nodes, job.partition, job.batch_host) == (8, ("s1",), "service", "s1")
    assert job.comment == "torchpass:run_dir=/shared/runs/d2e59aa3"
