"""CliSlurm: the exact argv of every operation, and what it makes of the answers."""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path

import pytest

from torchpass_slurm.errors import SlurmCommandError, SlurmError, SlurmTimeoutError
from torchpass_slurm.slurm.cli_backend import CliSlurm
from torchpass_slurm.slurm.steps import EXPANDED_NODE_UNSET, StepRequest, srun_argv, step_env

from .conftest import FakeRunner, fixture_text


def make(runner: FakeRunner) -> CliSlurm:
    return CliSlurm(runner)


def test_drain_argv(fake_runner: FakeRunner) -> None:
    fake_runner.on(["scontrol", "update", "NodeName=n2", "State=DRAIN", "Reason=tp: planned maintenance"])
    make(fake_runner).drain("n2", "tp: planned maintenance")
    assert len(fake_runner.calls) == 1


def test_drain_needs_a_reason(fake_runner: FakeRunner) -> None:
    with pytest.raises(ValueError):
        make(fake_runner).drain("n2", "  ")
    assert fake_runner.calls == []


def test_resume_argv(fake_runner: FakeRunner) -> None:
    fake_runner.on(["scontrol", "update", "NodeName=n2", "State=RESUME"])
    make(fake_runner).resume("n2")


def test_shrink_argv_compresses_the_kept_nodes(fake_runner: FakeRunner) -> None:
    fake_runner.on(["scontrol", "update", "JobId=7", "NodeList=n[1,3]"])
    make(fake_runner).shrink_job(7, ["n1", "n3"])


def test_shrink_to_nothing_is_refused(fake_runner: FakeRunner) -> None:
    with pytest.raises(ValueError):
        make(fake_runner).shrink_job(7, [])


def test_cancel_argv(fake_runner: FakeRunner) -> None:
    fake_runner.on(["scancel", "7"]).on(["scancel", "--signal=USR1", "7"])
    slurm = make(fake_runner)
    slurm.cancel(7)
    slurm.cancel(7, signal="USR1")
    assert [c.argv for c in fake_runner.calls] == [("scancel", "7"), ("scancel", "--signal=USR1", "7")]


def test_submit_text_goes_to_stdin(fake_runner: FakeRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_runner.on(["sbatch", "--parsable", "-N", "3"], fixture_text("24.11", "sbatch_parsable.txt"))
    script = "#!/bin/sh\nsrun hostname\n"
    monkeypatch.setenv("TP_BASE", "1")
    assert make(fake_runner).submit_batch(script, ["-N", "3"], env={"TP_EXTRA": "x"}) == 1
    call = fake_runner.calls[0]
    assert call.input == script
    assert call.env is not None and call.env["TP_EXTRA"] == "x" and call.env["TP_BASE"] == "1"


def test_submit_path_is_the_last_argument(fake_runner: FakeRunner, tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    fake_runner.on(["sbatch", "--parsable", str(script)], "42;tpfix\n")
    assert make(fake_runner).submit_batch(script) == 42
    assert fake_runner.calls[0].input is None and fake_runner.calls[0].env is None


@pytest.mark.parametrize("version", ["22.05", "24.11"])
def test_nodes_filters_after_parsing(fake_runner: FakeRunner, version: str) -> None:
    fake_runner.on(["sinfo", "--json"], fixture_text(version, "sinfo_mixed_drain.json"))
    slurm = make(fake_runner)
    assert [n.name for n in slurm.nodes(["n2"])] == ["n2"]
    assert slurm.nodes(partition="nosuch") == ()
    assert slurm.node("n2").is_draining


def test_unknown_node(fake_runner: FakeRunner) -> None:
    fake_runner.on(["sinfo", "--json"], fixture_text("24.11", "sinfo_idle.json"))
    with pytest.raises(SlurmError) as info:
        make(fake_runner).node("n9")
    assert info.value.message == "Slurm knows no node named 'n9'"


@pytest.mark.parametrize("version", ["22.05", "24.11"])
def test_job_reads_scontrol(fake_runner: FakeRunner, version: str) -> None:
    argv = ["scontrol", "-o", "show", "job", "1"]
    fake_runner.on(argv, fixture_text(version, "scontrol_show_job_shrunk.txt"))
    assert make(fake_runner).job(1).nodes == ("n1",)


@pytest.mark.parametrize("version", ["22.05", "24.11"])
def test_job_gone_carries_slurms_words_and_a_hint(fake_runner: FakeRunner, version: str) -> None:
    stderr = fixture_text(version, "scontrol_show_job_invalid.stderr").split("exit=")[0]
    argv = ["scontrol", "-o", "show", "job", "999999"]
    fake_runner.on(argv, SlurmCommandError(argv, 1, stderr))
    with pytest.raises(SlurmCommandError) as info:
        make(fake_runner).job(999999)
    err = info.value
    assert (err.argv, err.returncode) == (tuple(argv), 1)
    assert err.message == (
        "`scontrol -o show job 999999` exited with status 1: slurm_load_jobs error: Invalid job id specified"
    )
    assert "sacct -j 999999" in (err.hint or "")


def test_timeouts_pass_through_unchanged(fake_runner: FakeRunner) -> None:
    argv = ["scontrol", "-o", "show", "job", "5"]
    timeout = SlurmTimeoutError(argv, 30)
    fake_runner.on(argv, timeout)
    with pytest.raises(SlurmTimeoutError) as info:
        make(fake_runner).job(5)
    assert info.value is timeout


def test_jobs_filters_by_id(fake_runner: FakeRunner) -> None:
    fake_runner.on(["squeue", "--json", "--user=root"], fixture_text("22.05", "squeue_pending.json"))
    jobs = make(fake_runner).jobs([2], user="root")
    assert [j.job_id for j in jobs] == [2]


@pytest.mark.parametrize("version", ["22.05", "24.11"])
def test_ping_and_version(fake_runner: FakeRunner, version: str) -> None:
    fake_runner.on(["scontrol", "ping"], fixture_text(version, "scontrol_ping.txt"))
    fake_runner.on(["sinfo", "--version"], fixture_text(version, "sinfo_version.txt"))
    slurm = make(fake_runner)
    assert slurm.ping() is True
    assert slurm.version().major_minor == version
    slurm.version()
    assert [c.argv for c in fake_runner.calls].count(("sinfo", "--version")) == 1


def test_ping_down(fake_runner: FakeRunner) -> None:
    out = "Slurmctld(primary) at ctl is DOWN\n"
    fake_runner.on(["scontrol", "ping"], SlurmCommandError(["scontrol", "ping"], 1, "", stdout=out))
    assert make(fake_runner).ping() is False


def test_ping_other_failure_raises(fake_runner: FakeRunner) -> None:
    fake_runner.on(["scontrol", "ping"], SlurmCommandError(["scontrol", "ping"], 1, "no config"))
    with pytest.raises(SlurmCommandError):
        make(fake_runner).ping()


def test_srun_argv_uses_the_no_kill_flag() -> None:
    assert srun_argv(StepRequest(("python", "train.py"), "n3", job_id=7, ntasks=2, job_name="tp-rank")) == [
        "srun",
        "--no-kill",
        "--nodes=1",
        "--ntasks=2",
        "--nodelist=n3",
        "--jobid=7",
        "--job-name=tp-rank",
        "python",
        "train.py",
    ]
    assert srun_argv(StepRequest(("true",), "n1", extra_args=("--overlap",))) == [
        "srun",
        "--no-kill",
        "--nodes=1",
        "--ntasks=1",
        "--nodelist=n1",
        "--overlap",
        "true",
    ]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"command": (), "node": "n1"},
        {"command": ("x",), "node": "n[1-2]"},
        {"command": ("x",), "node": "n1", "ntasks": 0},
    ],
)
def test_srun_argv_rejects_nonsense(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        srun_argv(StepRequest(**kwargs))


def test_step_env_drops_slurm_no_kill() -> None:
    env = step_env({"PATH": "/bin", "SLURM_NO_KILL": "1"}, {"TP_RANK": "0", "SLURM_NO_KILL": "1"})
    assert env == {"PATH": "/bin", "TP_RANK": "0"}


def test_step_env_for_a_merged_node_drops_cpus_per_task_of_every_het_component() -> None:
    """Measured on Slurm 24.11: a step on a node merged into a heterogeneous job's component
    stayed pending ("Requested nodes are busy") with SLURM_CPUS_PER_TASK_HET_GROUP_1 set."""
    base = {
        "PATH": "/bin",
        "SLURM_CPUS_PER_TASK": "2",
        "SLURM_CPUS_PER_TASK_HET_GROUP_0": "2",
        "SLURM_CPUS_PER_TASK_HET_GROUP_1": "1",
        "SLURM_CPUS_PER_TASK_PACK_GROUP_1": "1",
        "SLURM_TRES_PER_TASK_HET_GROUP_1": "cpu=1",
        "SLURM_CPUS_ON_NODE": "2",
        "SLURM_JOB_NODELIST_HET_GROUP_1": "c[1-4]",
    }
    env = step_env(base, {"TP_RANK": "0"}, EXPANDED_NODE_UNSET)
    assert env == {
        "PATH": "/bin",
        "SLURM_CPUS_ON_NODE": "2",
        "SLURM_JOB_NODELIST_HET_GROUP_1": "c[1-4]",
        "TP_RANK": "0",
    }
    assert step_env(base) == base  # a node of the original allocation keeps them


def test_launch_step_spawns_srun_without_slurm_no_kill(
    fake_runner: FakeRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_NO_KILL", "1")
    step = StepRequest(("python", "-m", "worker"), "n2", job_id=9, env={"TP_RANK": "1"})
    fake_runner.on(srun_argv(step))
    proc = make(fake_runner).launch_step(step)
    assert proc.wait(timeout=10) == 0
    env = fake_runner.calls[0].env
    assert env is not None and "SLURM_NO_KILL" not in env and env["TP_RANK"] == "1"
    assert env["PATH"] == os.environ["PATH"]


def test_the_default_partition_is_the_one_scontrol_marks_default(fake_runner: FakeRunner) -> None:
    """A service partition beside the default one (issue 15) must not count towards what a job
    without -p can get: tp-submit sizes it by the default partition."""
    fake_runner.on(
        ["scontrol", "show", "partition", "-o"],
        "PartitionName=debug AllowGroups=ALL Default=YES Nodes=c[1-5] State=UP\n"
        "PartitionName=service AllowGroups=ALL Default=NO Nodes=s1 State=UP\n",
    )
    assert make(fake_runner).default_partition() == "debug"


def test_no_default_partition_is_none(fake_runner: FakeRunner) -> None:
    fake_runner.on(["scontrol", "show", "partition", "-o"], "PartitionName=service Default=NO Nodes=s1\n")
    assert make(fake_runner).default_partition() is None


def _job_line(job_id: int, nodes: str) -> str:
    """``scontrol -o show job`` of a running job: the recorded line with its id and nodes."""
    line = fixture_text("24.11", "scontrol_show_job_running.txt")
    line = line.replace("JobId=1 ", f"JobId={job_id} ", 1)
    return " ".join(f"NodeList={nodes}" if w.startswith("NodeList=") else w for w in line.split(" "))


def salloc_7(wait_s: int = 60) -> list[str]:
    """The request for a node for job 7 that the merge tests below expect."""
    return [
        "salloc",
        "--no-shell",
        "-N1",
        "--dependency=expand:7",
        f"--immediate={wait_s}",
        "--job-name=tp-spare-7",
    ]


def _job_7_in_turn(fake_runner: FakeRunner, first: list[str], then: str) -> None:
    """``scontrol -o show job 7`` answers ``first`` in turn, then ``then`` for good (the job's
    nodes before and after a merge)."""
    answers = iter(first)
    fake_runner.on(["scontrol", "-o", "show", "job", "7"], first[0])
    real_run = fake_runner.run

    def run(argv, **kw):  # type: ignore[no-untyped-def]
        if list(argv) == ["scontrol", "-o", "show", "job", "7"]:
            fake_runner.answers[tuple(argv)] = next(answers, then)
        return real_run(argv, **kw)

    fake_runner.run = run  # type: ignore[method-assign]


def test_expand_job_asks_for_one_node_beside_the_job_and_merges_it(fake_runner: FakeRunner) -> None:
    fake_runner.on(["scontrol", "-o", "show", "job", "7"], _job_line(7, "c[1-3]"))
    salloc = salloc_7()
    fake_runner.on([*salloc, "--partition=debug", "--exclude=c[1-3,5]"], "salloc: Granted job allocation 9\n")
    fake_runner.on(["scontrol", "-o", "show", "job", "9"], _job_line(9, "c4"))
    fake_runner.on(["scontrol", "update", "JobId=9", "NumNodes=0"])
    fake_runner.on(["scontrol", "update", "JobId=7", "NumNodes=ALL"])

    assert make(fake_runner).expand_job(7, wait_s=60, exclude=["c5"]) == ("c4",)
    assert [c.argv[:3] for c in fake_runner.calls][-3:-1] == [
        ("scontrol", "update", "JobId=9"),
        ("scontrol", "update", "JobId=7"),
    ]
    # then the job's nodes are read once more: none it had left came back, nothing is shrunk
    assert fake_runner.calls[-1].argv == ("scontrol", "-o", "show", "job", "7")


def test_a_node_the_job_had_left_that_the_merge_gives_back_is_released_again(
    fake_runner: FakeRunner,
) -> None:
    """Slurm 24.11: after a merge the job held c3 again, which it had shrunk out (dead)."""
    before, after = _job_line(7, "c[1-2]"), _job_line(7, "c[1-3,5]")
    _job_7_in_turn(fake_runner, [before, before], after)
    salloc = salloc_7()
    fake_runner.on([*salloc, "--partition=debug", "--exclude=c[1-3]"], "salloc: Granted job allocation 9\n")
    fake_runner.on(["scontrol", "-o", "show", "job", "9"], _job_line(9, "c5"))
    fake_runner.on(["scontrol", "update", "JobId=9", "NumNodes=0"])
    fake_runner.on(["scontrol", "update", "JobId=7", "NumNodes=ALL"])
    fake_runner.on(["scontrol", "update", "JobId=7", "NodeList=c[1-2,5]"])
    assert make(fake_runner).expand_job(7, wait_s=60, exclude=["c3"]) == ("c5",)
    assert fake_runner.calls[-1].argv == ("scontrol", "update", "JobId=7", "NodeList=c[1-2,5]")


def test_a_merge_slurm_22_05_declines_for_now_is_done_when_the_job_holds_the_node(
    fake_runner: FakeRunner,
) -> None:
    """Slurm 22.05 without accounting refuses NumNodes=ALL for good ("the DB index is being
    set"), but NumNodes=0 has moved the node into the job already (steps run on it)."""
    before, after = _job_line(7, "c[1-3]"), _job_line(7, "c[1-4]")
    _job_7_in_turn(fake_runner, [before, before], after)
    salloc = salloc_7()
    fake_runner.on([*salloc, "--partition=debug", "--exclude=c[1-3]"], "salloc: Granted job allocation 9\n")
    fake_runner.on(["scontrol", "-o", "show", "job", "9"], _job_line(9, "c4"))
    fake_runner.on(["scontrol", "update", "JobId=9", "NumNodes=0"])
    not_yet = SlurmCommandError(
        ["scontrol"],
        1,
        "Job update not available right now, the DB index is being set, try again in a bit for job 7",
    )
    fake_runner.on(["scontrol", "update", "JobId=7", "NumNodes=ALL"], not_yet)
    assert make(fake_runner).expand_job(7, wait_s=60) == ("c4",)
    assert not [c for c in fake_runner.calls if c.argv[0] == "scancel"]


def test_a_merge_declined_for_now_without_the_node_in_the_job_gives_it_back(fake_runner: FakeRunner) -> None:
    fake_runner.on(["scontrol", "-o", "show", "job", "7"], _job_line(7, "c1"))
    salloc = salloc_7(5)
    fake_runner.on([*salloc, "--partition=debug", "--exclude=c1"], "salloc: Granted job allocation 9\n")
    fake_runner.on(["scontrol", "-o", "show", "job", "9"], _job_line(9, "c2"))
    fake_runner.on(["scontrol", "update", "JobId=9", "NumNodes=0"])
    not_yet = SlurmCommandError(["scontrol"], 1, "the DB index is being set, try again in a bit")
    fake_runner.on(["scontrol", "update", "JobId=7", "NumNodes=ALL"], not_yet)
    fake_runner.on(["scancel", "9"])

    with pytest.raises(SlurmError, match="try again"):
        make(fake_runner).expand_job(7, wait_s=5)
    assert fake_runner.calls[-1].argv == ("scancel", "9")


def test_a_merge_that_fails_gives_the_node_back(fake_runner: FakeRunner) -> None:
    fake_runner.on(["scontrol", "-o", "show", "job", "7"], _job_line(7, "c1"))
    salloc = salloc_7(5)
    fake_runner.on([*salloc, "--partition=debug", "--exclude=c1"], "salloc: Granted job allocation 9\n")
    fake_runner.on(["scontrol", "-o", "show", "job", "9"], _job_line(9, "c2"))
    refused = SlurmCommandError(["scontrol"], 1, "scontrol: error: Job expansion not permitted")
    fake_runner.on(["scontrol", "update", "JobId=9", "NumNodes=0"], refused)
    fake_runner.on(["scancel", "9"])

    with pytest.raises(SlurmError, match="not permitted"):
        make(fake_runner).expand_job(7, wait_s=5)
    assert fake_runner.calls[-1].argv == ("scancel", "9")


def test_a_node_the_job_holds_already_is_given_back_not_merged(fake_runner: FakeRunner) -> None:
    """Slurm shares nodes between allocations: a request made before the job got c3 may be given
    c3 too. Merging it again took a CPU off the job on 24.11 (4 nodes, 3 CPUs)."""
    fake_runner.on(["scontrol", "-o", "show", "job", "7"], _job_line(7, "c[1-3]"))
    salloc = salloc_7(5)
    fake_runner.on([*salloc, "--partition=debug", "--exclude=c[1-3]"], "salloc: Granted job allocation 9\n")
    fake_runner.on(["scontrol", "-o", "show", "job", "9"], _job_line(9, "c3"))
    fake_runner.on(["scancel", "9"])

    with pytest.raises(SlurmError, match="a node it holds already"):
        make(fake_runner).expand_job(7, wait_s=5)
    assert fake_runner.calls[-1].argv == ("scancel", "9")
    assert not [c for c in fake_runner.calls if "NumNodes=ALL" in c.argv]


def test_a_salloc_killed_at_its_timeout_has_its_request_withdrawn(fake_runner: FakeRunner) -> None:
    """salloc withdraws its request when --immediate runs out, but not when it is killed: a
    request left pending would be granted a node that nobody merges."""
    fake_runner.on(["scontrol", "-o", "show", "job", "7"], _job_line(7, "c1"))
    salloc = salloc_7(5)
    fake_runner.on([*salloc, "--partition=debug", "--exclude=c1"], SlurmTimeoutError(salloc, 35))
    fake_runner.on(["scancel", "--name=tp-spare-7"])

    with pytest.raises(SlurmTimeoutError):
        make(fake_runner).expand_job(7, wait_s=5)
    assert fake_runner.calls[-1].argv == ("scancel", "--name=tp-spare-7")


def test_slurmd_started_reads_scontrol_for_the_nodes_asked(fake_runner: FakeRunner) -> None:
    fake_runner.on(
        ["scontrol", "-o", "show", "node", "n[1-2]"], fixture_text("24.11", "scontrol_show_node_idle.txt")
    )
    started = make(fake_runner).slurmd_started(["n2", "n1"])
    assert started == dict.fromkeys(["n1", "n2"], datetime.fromisoformat("2026-11-30T08:45:14").timestamp())
    assert make(fake_runner).slurmd_started([]) == {}


def test_config_value_reads_one_setting(fake_runner: FakeRunner) -> None:
    fake_runner.on(
        ["scontrol", "show", "config"],
        "Configuration data as of x\nPrologFlags             = Alloc,Contain\n",
    )
    slurm = make(fake_runner)
    assert slurm.config_value("PrologFlags") == "Alloc,Contain"
    assert slurm.config_value("NoSuchKey") is None


def test_step_env_drops_what_a_step_on_a_merged_node_must_not_inherit() -> None:
    from torchpass_slurm.slurm.steps import EXPANDED_NODE_UNSET

    base = {"SLURM_CPUS_PER_TASK": "1", "SLURM_TRES_PER_TASK": "cpu=1", "SLURM_JOB_ID": "7"}
    assert step_env(base, {"X": "1"}, EXPANDED_NODE_UNSET) == {"SLURM_JOB_ID": "7", "X": "1"}
    assert step_env(base, {"X": "1"}) == {**base, "X": "1"}
