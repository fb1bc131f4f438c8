"""tp-submit end to end, with a fake Submitter: full output and exit code of each case."""

from __future__ import annotations

import stat
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from click.testing import CliRunner

from torchpass_slurm.cli import submit as cli
from torchpass_slurm.cli.app import run_cli
from torchpass_slurm.errors import SlurmCommandError, SlurmNotFoundError

SCRIPT = """#!/bin/bash
#SBATCH -N 2
#SBATCH --time=10:00
#TP --spares=1

tp run python train.py
"""


@dataclass
class FakeSubmitter:
    """Records what would be submitted; answers partition sizes from a table."""

    job_id: str = "4242"
    partitions: dict[str | None, int] = field(default_factory=lambda: {None: 8, "small": 2})
    error: Exception | None = None
    submitted: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    asked: list[str | None] = field(default_factory=list)

    def submit_batch(self, script: str, sbatch_args: Sequence[str]) -> str:
        if self.error is not None:
            raise self.error
        self.submitted.append((script, tuple(sbatch_args)))
        return self.job_id + "\n"

    def partition_node_count(self, partition: str | None) -> int | None:
        self.asked.append(partition)
        return self.partitions.get(partition)


@dataclass
class Outcome:
    code: int
    out: str
    err: str


@pytest.fixture
def fake(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> FakeSubmitter:
    submitter = FakeSubmitter()
    monkeypatch.setattr(cli, "make_submitter", lambda: submitter)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SBATCH_PARTITION", raising=False)
    monkeypatch.delenv("TORCHPASS_SUPERVISOR_PARTITION", raising=False)
    outside = tmp_path_factory.mktemp("home")  # not in the job's folder, which tests list
    monkeypatch.setenv("TORCHPASS_SUBMIT_CONFIG", str(outside / "no-site-config.toml"))
    # this user has seen the note about the batch host (tests of the note make their own)
    monkeypatch.setenv("XDG_STATE_HOME", str(outside / "state"))
    cli.note_marker().parent.mkdir(parents=True)
    cli.note_marker().touch()
    (tmp_path / "train.sh").write_text(SCRIPT)
    return submitter


def tp_submit(*argv: str) -> Outcome:
    with CliRunner().isolation() as (out, err, _):
        code = run_cli(cli.tp_submit, list(argv), prog_name="tp-submit")
    return Outcome(code, out.getvalue().decode(), err.getvalue().decode())


# --- submitting -------------------------------------------------------------------


def test_submit_script(fake: FakeSubmitter, tmp_path: Path) -> None:
    result = tp_submit("--run-dir", "runs/r1", "-p", "small", "--spares=0", "train.sh", "x")
    run_dir = tmp_path / "runs" / "r1"
    assert result == Outcome(
        0, f"Submitted batch job 4242 (2 nodes + 0 hot spares; run dir: {run_dir})\n", ""
    )
    ((script, args),) = fake.submitted
    assert args == (
        "--job-name=train.sh",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--no-kill",
        f"--output={run_dir}/slurm-%j.out",
        f"--comment=torchpass:run_dir={run_dir}",
        "--partition=small",
        "--time=10:00",
    )
    secret = run_dir / ".torchpass" / "secret"
    assert f"export TORCHPASS_SECRET_FILE={secret}\n" in script
    assert "set -- x\n" in script
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600  # the real create_secret
    assert stat.S_IMODE(secret.parent.stat().st_mode) == 0o700
    assert secret.read_text().strip() not in script
    assert fake.asked == ["small"]


def test_submit_command_parsable(fake: FakeSubmitter, tmp_path: Path) -> None:
    result = tp_submit("--parsable", "-N", "3", "--spares", "2", "--", "sh", "-c", "echo hi")
    assert result == Outcome(0, "4242\n", "")
    ((script, args),) = fake.submitted
    assert args[:4] == ("--job-name=sh", "--nodes=5", "--ntasks-per-node=1", "--no-kill")
    assert script.endswith("\nexec tp run -- sh -c 'echo hi'\n")
    (run_dir,) = (tmp_path / "torchpass-runs").iterdir()
    assert run_dir.name.startswith("sh-")


def test_a_taken_default_run_dir_gets_a_number(
    fake: FakeSubmitter, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for _ in range(2):
        assert tp_submit("--parsable", "--", "true").code == 0
    names = sorted(p.name for p in (tmp_path / "torchpass-runs").iterdir())
    # two submissions within one second share a time stamp; otherwise both are plain
    assert len(names) == 2 and (names[1] == names[0] + "-2" or "-2" not in names[1])


def test_sbatch_failure_is_shown_as_sbatch_said_it_and_cleans_up(fake: FakeSubmitter, tmp_path: Path) -> None:
    fake.error = SlurmCommandError(
        ["sbatch", "--parsable", "--nodes=2"],
        1,
        "sbatch: error: Batch job submission failed: Invalid account or account/partition "
        "combination specified\n",
    )
    result = tp_submit("--run-dir", "r", "train.sh")
    assert result == Outcome(
        3,
        "",
        (
            "error: `sbatch --parsable --nodes=2` exited with status 1: sbatch: error: Batch job submission "
            "failed: Invalid account or account/partition combination specified\n"
        ),
    )
    assert not (tmp_path / "r").exists()


def test_sbatch_missing(fake: FakeSubmitter) -> None:
    fake.error = SlurmNotFoundError("sbatch")
    result = tp_submit("--", "true")
    assert result.code == 3
    assert result.err == (
        "error: the Slurm command `sbatch` was not found on PATH\n"
        "  hint: run this on a Slurm login or compute node, or add Slurm's bin "
        "directory to PATH.\n"
    )


# --- dry run ----------------------------------------------------------------------


def test_dry_run_prints_and_creates_nothing(fake: FakeSubmitter, tmp_path: Path) -> None:
    result = tp_submit("--dry-run", "--run-dir", "/shared/r", "--mail-type", "END", "train.sh")
    assert result == Outcome(
        0,
        """\
# tp-submit --dry-run: nothing was submitted, nothing was created.
# The sbatch command (the script below goes to its stdin):
sbatch --parsable --job-name=train.sh --nodes=3 --ntasks-per-node=1 --no-kill --output=/shared/r/slurm-%j.out --comment=torchpass:run_dir=/shared/r --time=10:00 --mail-type END
# The batch script:
#!/bin/bash
# Rendered by tp-submit from train.sh: 2 nodes + 1 hot spare.
# sbatch gets its options on its command line (--nodes=3 --no-kill ...).
export TORCHPASS_NODES=2
export TORCHPASS_SPARES=1
export TORCHPASS_NTASKS_PER_NODE=1
export TORCHPASS_RUN_DIR=/shared/r
export TORCHPASS_SECRET_FILE=/shared/r/.torchpass/secret
# ---- train.sh, without its #! line; its #SBATCH lines are inert here ----
#SBATCH -N 2
#SBATCH --time=10:00
#TP --spares=1

tp run python train.py
""",  # noqa: E501 (the dry run's output, verbatim)
        "",
    )
    assert fake.submitted == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.sh"]


def test_dry_run_without_slurm_warns(fake: FakeSubmitter, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_sinfo(partition: str | None) -> int | None:
        raise SlurmNotFoundError("sinfo")

    monkeypatch.setattr(fake, "partition_node_count", no_sinfo)
    result = tp_submit("--dry-run", "--", "true")
    assert result.code == 0
    assert result.err == (
        "warning: could not check the partition's size: the Slurm command `sinfo` was not found on PATH\n"
    )
    assert tp_submit("--", "true").code == 3  # a real submission does not guess


# --- refusals: nothing is submitted -------------------------------------------------


def refused(result: Outcome, fake: FakeSubmitter, err: str, tmp_path: Path) -> None:
    assert result == Outcome(2, "", err)
    assert fake.submitted == []
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "train.sh") == []


def test_refuses_spares_the_partition_cannot_hold(fake: FakeSubmitter, tmp_path: Path) -> None:
    refused(
        tp_submit("-p", "small", "train.sh"),
        fake,
        (
            "error: the job needs 3 nodes (2 active + 1 hot spare), but partition 'small' has only 2 nodes\n"
            "  hint: lower --spares or -N, or pick a larger partition with -p\n"
        ),
        tmp_path,
    )


def test_partition_from_sbatch_environment(
    fake: FakeSubmitter, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SBATCH_PARTITION", "small")
    assert tp_submit("train.sh").code == 2
    assert fake.asked == ["small"]


def test_refuses_non_numeric_spares(fake: FakeSubmitter, tmp_path: Path) -> None:
    refused(
        tp_submit("--spares", "abc", "train.sh"),
        fake,
        "error: the number of hot spares must be a whole number, got --spares abc\n",
        tmp_path,
    )


def test_refuses_conflicting_counts(fake: FakeSubmitter, tmp_path: Path) -> None:
    refused(
        tp_submit("-n", "3", "train.sh"),
        fake,
        (
            "error: -n 3 tasks do not spread evenly over -N 2 (train.sh line 2) nodes\n"
            "  hint: tp runs the same number of tasks on every node\n"
        ),
        tmp_path,
    )


def test_refuses_a_missing_script(fake: FakeSubmitter, tmp_path: Path) -> None:
    refused(
        tp_submit("nope.sh"),
        fake,
        (
            f"error: the batch script nope.sh does not exist (looked for {tmp_path}/nope.sh)\n"
            "  hint: to run a program without a script: tp-submit [OPTIONS] -- COMMAND...\n"
        ),
        tmp_path,
    )


def test_refuses_an_unreadable_script(
    fake: FakeSubmitter, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def denied(self: Path, *args: object, **kwargs: object) -> str:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_text", denied)  # chmod 0 would not stop root
    refused(
        tp_submit("train.sh"),
        fake,
        "error: the batch script train.sh is not readable (permission denied)\n",
        tmp_path,
    )


def test_refuses_a_directory_as_script(fake: FakeSubmitter, tmp_path: Path) -> None:
    result = tp_submit(str(tmp_path))
    assert result == Outcome(2, "", f"error: the batch script {tmp_path} is a directory, not a file\n")


def test_refuses_a_missing_interpreter(fake: FakeSubmitter, tmp_path: Path) -> None:
    (tmp_path / "train.sh").write_text("#!/no/such/bash\ntp run true\n")
    refused(
        tp_submit("train.sh"),
        fake,
        (
            "error: the interpreter of train.sh (#!/no/such/bash) was not found on this node\n"
            "  hint: fix its #! line, e.g. #!/bin/bash\n"
        ),
        tmp_path,
    )
    (tmp_path / "train.sh").write_text("#!/usr/bin/env no-such-shell\ntp run true\n")
    assert "was not found on this node" in tp_submit("train.sh").err


def test_refuses_a_script_that_is_not_a_shell_script(fake: FakeSubmitter, tmp_path: Path) -> None:
    (tmp_path / "train.sh").write_text(f"#!/usr/bin/env {Path(sys.executable).name}\nprint(1)\n")
    name = Path(sys.executable).name
    refused(
        tp_submit("train.sh"),
        fake,
        (
            f"error: train.sh is run by {name} (#!/usr/bin/env {name}), not by a shell; tp-submit puts "
            "`export` lines in front of it, so it must be a shell script\n"
            f"  hint: call it from a bash script with `tp run {name} ...`, "
            f"or use tp-submit [OPTIONS] -- {name} ...\n"
        ),
        tmp_path,
    )


def test_refuses_a_command_not_on_path(fake: FakeSubmitter, tmp_path: Path) -> None:
    refused(
        tp_submit("--", "pyhton", "train.py"),
        fake,
        (
            "error: the command 'pyhton' was not found on this node's PATH\n"
            "  hint: check the spelling, or load its module before tp-submit (the job starts with this "
            "environment); a program that exists only on the compute nodes can be started from a batch "
            "script with `tp run COMMAND`, which tp-submit does not check\n"
        ),
        tmp_path,
    )


def test_command_paths_are_checked_relative_to_chdir(fake: FakeSubmitter, tmp_path: Path) -> None:
    (tmp_path / "work").mkdir()
    tool = tmp_path / "work" / "run.sh"
    tool.write_text("#!/bin/sh\n")
    result = tp_submit("--dry-run", "-D", "work", "--", "./run.sh")
    assert (
        result.err == f"error: the command ./run.sh is not executable ({tool})\n  hint: chmod +x ./run.sh\n"
    )
    tool.chmod(0o755)
    assert tp_submit("--dry-run", "-D", "work", "--", "./run.sh").code == 0
    assert tp_submit("--dry-run", "--", "./run.sh").err == (
        f"error: the command ./run.sh does not exist (looked for {tmp_path}/run.sh)\n"
    )


def test_refuses_a_run_dir_in_use(fake: FakeSubmitter, tmp_path: Path) -> None:
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "events.jsonl").write_text("")
    result = tp_submit("--run-dir", "r", "train.sh")
    assert result == Outcome(
        2,
        "",
        (
            f"error: the run dir {tmp_path}/r already exists and is not empty\n"
            "  hint: each job needs its own run dir: pick another --run-dir\n"
        ),
    )
    assert fake.submitted == []


def test_an_empty_existing_run_dir_is_fine(fake: FakeSubmitter, tmp_path: Path) -> None:
    (tmp_path / "r").mkdir()
    assert tp_submit("--parsable", "--run-dir", "r", "train.sh").code == 0
    assert (tmp_path / "r" / ".torchpass" / "secret").exists()


def test_usage_errors(fake: FakeSubmitter, tmp_path: Path) -> None:
    refused(
        tp_submit(),
        fake,
        (
            "error: no batch script and no command given\n"
            "  hint: usage: tp-submit [OPTIONS] SCRIPT [ARGS...]  or  tp-submit [OPTIONS] -- COMMAND...\n"
        ),
        tmp_path,
    )


# --- help ---------------------------------------------------------------------------


def test_help(fake: FakeSubmitter) -> None:
    result = tp_submit("--help")
    assert result.code == 0 and result.err == ""
    assert result.out.startswith(
        "Usage: tp-submit [OPTIONS] SCRIPT [ARGS]...  |  [OPTIONS] -- COMMAND...\n\n"
        "  Submit a training job with hot-spare nodes: sbatch, plus --spares.\n"
    )
    assert "./torchpass-runs/<job-name>-<YYYYmmdd-HHMMSS>" in result.out
    assert tp_submit("-h").out == result.out
    assert fake.asked == []


def test_help_is_instant_without_heavy_imports() -> None:
    code = (
        "import sys; from torchpass_slurm.cli import submit; "
        "print(sorted(m for m in ('torch', 'mpi4py', 'rich', 'zmq') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == "[]\n"


# --- the real Submitter adapter, over a fake Slurm backend ---------------------------


class FakeSlurm:
    """The two calls of a torchpass_slurm.slurm backend that tp-submit uses."""

    def __init__(self, nodes: dict[str, tuple[str, ...]]) -> None:
        self.node_partitions = nodes
        self.submitted: list[tuple[str, list[str]]] = []

    def nodes(self, names: None = None, *, partition: str | None = None) -> tuple[str, ...]:
        return tuple(
            n for n, parts in self.node_partitions.items() if partition is None or partition in parts
        )

    def submit_batch(self, script: str, args: Sequence[str] = ()) -> int:
        self.submitted.append((script, list(args)))
        return 77


def test_adapter_submits_the_script_text() -> None:
    slurm = FakeSlurm({})
    assert cli.SlurmSubmitter(slurm).submit_batch("#!/bin/sh\n", ("--nodes=3",)) == "77"
    assert slurm.submitted == [("#!/bin/sh\n", ["--nodes=3"])]


def test_adapter_counts_partition_nodes() -> None:
    submitter = cli.SlurmSubmitter(
        FakeSlurm({"c1": ("debug", "all"), "c2": ("debug", "all"), "c3": ("all", "gpu")})
    )
    assert [submitter.partition_node_count(p) for p in (None, "all", "gpu", "nope")] == [3, 3, 1, None]


# --- issue 11, item 7: counts are ASCII digits; spares beyond the partition --------------------


@pytest.mark.parametrize(
    ("argv", "err"),
    [
        (("--spares=²",), "error: the number of hot spares must be a whole number, got --spares=²\n"),
        (("--spares", "٣"), "error: the number of hot spares must be a whole number, got --spares ٣\n"),
        (("-n", "²"), "error: the number of tasks must be a whole number, got -n ²\n"),
        (("--ntasks=٢",), "error: the number of tasks must be a whole number, got --ntasks=٢\n"),
        (
            ("-N", "٣"),
            "error: -N ٣: the node count must be a whole number, not '٣'\n"
            "  hint: tp needs a fixed number of active nodes, e.g. -N 4\n",
        ),
    ],
    ids=[
        "spares-superscript",
        "spares-arabic-indic",
        "ntasks-superscript",
        "ntasks-arabic-indic",
        "nodes-arabic-indic",
    ],
)
def test_counts_are_ascii_digits_and_say_so_without_a_traceback(
    fake: FakeSubmitter, tmp_path: Path, argv: tuple[str, ...], err: str
) -> None:
    refused(tp_submit(*argv, "train.sh"), fake, err, tmp_path)


def test_a_tp_directive_with_a_non_ascii_count_is_refused(fake: FakeSubmitter, tmp_path: Path) -> None:
    (tmp_path / "train.sh").write_text(SCRIPT.replace("#TP --spares=1", "#TP --spares=١"))  # noqa: RUF001 (a non-ASCII digit, on purpose)
    result = tp_submit("train.sh")
    assert (result.code, result.out) == (2, "")
    assert result.err.startswith("error: the number of hot spares must be a whole number, got --spares=١")  # noqa: RUF001 (a non-ASCII digit, on purpose)
    assert fake.submitted == []


def test_spares_beyond_the_partition_are_refused(fake: FakeSubmitter, tmp_path: Path) -> None:
    refused(
        tp_submit("--spares", "99", "-p", "small", "train.sh"),
        fake,
        (
            "error: the job needs 101 nodes (2 active + 99 hot spares), "
            "but partition 'small' has only 2 nodes\n"
            "  hint: lower --spares or -N, or pick a larger partition with -p\n"
        ),
        tmp_path,
    )


def test_spares_are_submitted_with_a_warning_when_the_partition_size_is_unknown(fake: FakeSubmitter) -> None:
    result = tp_submit("--parsable", "--spares", "99", "-p", "elsewhere", "train.sh")
    assert result == Outcome(
        0,
        "4242\n",
        (
            "warning: could not check the partition's size: Slurm lists no nodes in partition 'elsewhere'; "
            "not checked that the job's 101 nodes (2 active + 99 hot spares) fit (a job larger than its "
            "partition is never started)\n"
        ),
    )
    assert len(fake.submitted) == 1
