"""tp-submit's parsing: the command line, #SBATCH / #TP lines, precedence, pass-through."""

from __future__ import annotations

from datetime import datetime

import pytest

from torchpass_slurm.errors import SubmitError
from torchpass_slurm.submit import (
    Option,
    parse_batch_script,
    parse_submit_args,
    render_batch_script,
    resolve_job_spec,
    sbatch_arguments,
)

NOW = datetime(2025, 3, 4, 5, 6, 7)


def spec_of(argv: list[str], script_text: str | None = None, cwd: str = "/home/u/proj"):
    request = parse_submit_args(argv)
    script = parse_batch_script(script_text, request.script) if script_text is not None else None
    return resolve_job_spec(request, script, cwd=cwd, now=NOW)


SCRIPT = """#!/bin/bash
#SBATCH -N 2
#SBATCH --time=10:00 -c 4   # a comment
# an ordinary comment
#SBATCH --mail-type END
#TP --spares=1

#SBATCH --nodes=9
srun hostname
"""


# --- the command line -----------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["-N3", "s.sh"],
        ["-N", "3", "s.sh"],
        ["--nodes=3", "s.sh"],
        ["--nodes", "3", "s.sh"],
        ["--nodes=3-3", "s.sh"],
        ["--nodes", " 3", "s.sh"],
    ],
)
def test_node_count_forms(argv: list[str]) -> None:
    assert spec_of(argv, "#!/bin/sh\n").nodes == 3


def test_script_mode_splits_options_script_and_its_args() -> None:
    request = parse_submit_args(["-t", "5", "--spares", "2", "run.sh", "--spares", "x", "--", "y"])
    assert request.script == "run.sh"
    assert request.script_args == ("--spares", "x", "--", "y")
    assert [o.tokens for o in request.options] == [("-t", "5"), ("--spares", "2")]
    assert request.command == ()


def test_command_mode_takes_everything_after_double_dash() -> None:
    request = parse_submit_args(["-N", "2", "--", "python", "-u", "train.py", "--lr=0.1"])
    assert request.command == ("python", "-u", "train.py", "--lr=0.1")
    assert request.script is None


def test_short_options_cluster_like_getopt() -> None:
    request = parse_submit_args(["-vkN3", "s.sh"])
    assert [(o.name, o.value, o.tokens) for o in request.options] == [
        ("verbose", None, ("-v",)),
        ("no-kill", "N3", ("-kN3",)),  # -k takes an optional attached value, as in sbatch
    ]
    request = parse_submit_args(["-vHN3", "s.sh"])
    assert [(o.name, o.value, o.tokens) for o in request.options] == [
        ("verbose", None, ("-v",)),
        ("hold", None, ("-H",)),
        ("nodes", "3", ("-N3",)),
    ]


def test_long_options_may_be_abbreviated_like_getopt() -> None:
    assert parse_submit_args(["--part=debug", "s.sh"]).options[0].name == "partition"
    with pytest.raises(
        SubmitError,
        match=r"--node \(the command line\) is ambiguous: it could be "
        r"--nodefile, --nodelist, --nodes",
    ):
        parse_submit_args(["--node=3", "s.sh"])


def test_a_required_value_swallows_the_next_word() -> None:
    request = parse_submit_args(["--time", "10:00", "-o", "out.txt", "s.sh"])
    assert request.script == "s.sh"


def test_unknown_long_options_pass_through_as_written() -> None:
    spec = spec_of(["--future-option=7", "--other", "-t", "5", "s.sh"], "#!/bin/sh\n")
    assert spec.sbatch_passthrough == ("--future-option=7", "--other", "-t", "5")


def test_help_needs_no_script() -> None:
    assert parse_submit_args(["-h"]).help
    assert parse_submit_args(["-t", "5", "--help"]).help
    assert not parse_submit_args(["s.sh", "--help"]).help  # after SCRIPT: the script's


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "no batch script and no command given"),
        (["-N", "2"], "no batch script and no command given"),
        (["--"], "nothing after `--`: expected the command to run"),
        (["-"], "tp-submit cannot read the batch script from stdin"),
        (["-Z", "s.sh"], "unknown option -Z in '-Z' (the command line)"),
        (["--time"], "--time (the command line) needs a value"),
        (["-N"], "--nodes (the command line) needs a value"),
        (
            ["--parsable=yes", "s.sh"],
            "--parsable (the command line) takes no value, but was given '--parsable=yes'",
        ),
    ],
)
def test_command_line_errors(argv: list[str], message: str) -> None:
    with pytest.raises(SubmitError) as info:
        parse_submit_args(argv)
    assert info.value.message == message


# --- #SBATCH and #TP lines ------------------------------------------------------


def test_directives_come_only_from_the_leading_comment_block() -> None:
    script = parse_batch_script(SCRIPT, "job.sh")
    assert script.shebang == "#!/bin/bash"
    assert [(o.name, o.value, o.origin) for o in script.directives] == [
        ("nodes", "2", "job.sh line 2"),
        ("time", "10:00", "job.sh line 3"),
        ("cpus-per-task", "4", "job.sh line 3"),
        ("mail-type", "END", "job.sh line 5"),
        ("spares", "1", "job.sh line 6"),
        ("nodes", "9", "job.sh line 8"),  # blank lines do not end the block
    ]
    assert script.body == SCRIPT.split("\n", 1)[1]


def test_directives_stop_at_the_first_command() -> None:
    script = parse_batch_script("#!/bin/sh\n#SBATCH -N 2\necho hi\n#SBATCH -N 5\n", "j")
    assert [o.value for o in script.directives] == ["2"]


def test_lookalike_lines_are_plain_comments() -> None:
    script = parse_batch_script("#!/bin/sh\n# SBATCH -N 2\n#SBATCHX\n#TPU v4\n", "j")
    assert script.directives == ()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("echo hi\n", "the batch script j does not start with a #! line"),
        ("", "the batch script j does not start with a #! line"),
        (
            "#!/bin/sh\n#SBATCH --spares=2\n",
            "j line 2: --spares is tp-submit's option; sbatch does not know it",
        ),
        ("#!/bin/sh\n#TP -N 2\n", "unknown option -N in '-N' (j line 2)"),
        ("#!/bin/sh\n#TP --dry-run\n", "j line 2: --dry-run is not allowed in a #TP line"),
        ("#!/bin/sh\n#SBATCH -N 2 extra\n", "j line 2: unexpected 'extra' in '#SBATCH -N 2 extra'"),
        ("#!/bin/sh\n#SBATCH --comment='open\n", "cannot parse j line 2: No closing quotation"),
    ],
)
def test_directive_errors(text: str, message: str) -> None:
    with pytest.raises(SubmitError) as info:
        parse_batch_script(text, "j")
    assert info.value.message == message


def test_sbatch_spares_line_hints_at_tp_line() -> None:
    with pytest.raises(SubmitError) as info:
        parse_batch_script("#!/bin/sh\n#SBATCH --spares=2\n", "j")
    assert info.value.hint == "write it as `#TP --spares=2`"


# --- precedence and the resolved spec ---------------------------------------------


def test_script_directives_and_defaults() -> None:
    spec = spec_of(["job.sh", "a"], SCRIPT)
    assert (spec.nodes, spec.spares, spec.ntasks_per_node) == (9, 1, 1)  # the later line wins
    assert spec.job_name == "job.sh"
    assert spec.run_dir == "/home/u/proj/torchpass-runs/job.sh-20250304-050607"
    assert spec.secret_file == spec.run_dir + "/.torchpass/secret"
    assert spec.script_args == ("a",)
    assert spec.sbatch_passthrough == ("--time=10:00", "-c", "4", "--mail-type", "END")


def test_command_line_wins_and_comes_after_the_script_in_passthrough() -> None:
    spec = spec_of(["-N", "4", "--spares=0", "--time", "20:00", "-J", "big", "job.sh"], SCRIPT)
    assert (spec.nodes, spec.spares, spec.job_name) == (4, 0, "big")
    assert spec.sbatch_passthrough == ("--time=10:00", "-c", "4", "--mail-type", "END", "--time", "20:00")
    assert sbatch_arguments(spec) == (
        "--job-name=big",
        "--nodes=4",
        "--ntasks-per-node=1",
        "--no-kill",
        "--output=/home/u/proj/torchpass-runs/big-20250304-050607/slurm-%j.out",
        "--comment=torchpass:run_dir=/home/u/proj/torchpass-runs/big-20250304-050607",
        "--time=10:00",
        "-c",
        "4",
        "--mail-type",
        "END",
        "--time",
        "20:00",
    )


def test_a_comment_given_by_the_user_is_kept_and_not_doubled() -> None:
    spec = spec_of(["--comm", "mine", "--", "true"])  # a prefix, as sbatch allows
    args = sbatch_arguments(spec)
    assert [a for a in args if a.startswith("--comm")] == ["--comment=mine"]
    assert "mine" not in args


def test_no_kill_given_by_the_user_is_not_doubled() -> None:
    spec = spec_of(["-k", "--no-kill", "-N", "2", "--", "true"])
    assert sbatch_arguments(spec).count("--no-kill") == 1
    assert "-k" not in sbatch_arguments(spec)


def test_run_dir_chdir_output_partition() -> None:
    spec = spec_of(["-D", "work", "-o", "log/%j.out", "-p", "gpu", "--run-dir", "../runs/r1", "--", "true"])
    assert spec.run_dir == "/home/u/runs/r1"  # relative to where tp-submit runs
    assert sbatch_arguments(spec)[:8] == (
        "--job-name=true",
        "--nodes=1",
        "--ntasks-per-node=1",
        "--no-kill",
        "--output=log/%j.out",
        "--comment=torchpass:run_dir=/home/u/runs/r1",
        "--partition=gpu",
        "--chdir=work",
    )
    default = spec_of(["-D", "work", "-J", "a b/c", "--", "true"])
    assert default.run_dir == "/home/u/proj/work/torchpass-runs/a_b_c-20250304-050607"


@pytest.mark.parametrize(
    ("argv", "layout"),
    [
        (["--"], (1, 1)),
        (["-N", "2", "--ntasks-per-node", "4", "--"], (2, 4)),
        (["-N", "2", "-n", "8", "--"], (2, 4)),
        (["-n", "8", "--ntasks-per-node=4", "--"], (2, 4)),
        (["-N", "2", "-n", "8", "--ntasks-per-node=4", "--"], (2, 4)),
    ],
)
def test_task_layout(argv: list[str], layout: tuple[int, int]) -> None:
    spec = spec_of([*argv, "true"])
    assert (spec.nodes, spec.ntasks_per_node) == layout


@pytest.mark.parametrize(
    ("argv", "message", "hint"),
    [
        (
            ["-N", "2-4"],
            "-N 2-4: a range of node counts (2 to 4) is not supported",
            "tp needs a fixed number of active nodes: give one number, e.g. -N 4, "
            "and add hot spares with --spares",
        ),
        (
            ["--nodes=two"],
            "--nodes=two: the node count must be a whole number, not 'two'",
            "tp needs a fixed number of active nodes, e.g. -N 4",
        ),
        (["-N0"], "-N0: the job needs at least 1 node", None),
        (["--spares", "abc"], "the number of hot spares must be a whole number, got --spares abc", None),
        (["--spares=-1"], "the number of hot spares must be a whole number, got --spares=-1", None),
        (
            ["--ntasks-per-node=0"],
            "the number of tasks per node must be at least 1, got --ntasks-per-node=0",
            None,
        ),
        (["-n", "x"], "the number of tasks must be a whole number, got -n x", None),
        (
            ["-N", "2", "-n", "7"],
            "-n 7 tasks do not spread evenly over -N 2 nodes",
            "tp runs the same number of tasks on every node",
        ),
        (
            ["-n", "8"],
            "-n 8 alone does not say how many nodes the job needs",
            "give -N/--nodes too (or --ntasks-per-node)",
        ),
        (
            ["-n", "7", "--ntasks-per-node=2"],
            "-n 7 is not a multiple of --ntasks-per-node=2",
            "tp runs the same number of tasks on every node",
        ),
        (
            ["-N", "2", "-n", "6", "--ntasks-per-node=4"],
            "conflicting task counts: -n 6 but -N 2 x --ntasks-per-node=4 = 8",
            "drop -n/--ntasks: tp-submit derives it from -N and --ntasks-per-node",
        ),
        (
            ["--no-kill=off"],
            "--no-kill=off: tp needs --no-kill (a lost node must not end the job)",
            "remove it; tp-submit always passes --no-kill",
        ),
        (
            ["--wrap=hostname"],
            "--wrap=hostname: tp-submit does not take --wrap",
            "write the command after `--`: tp-submit [OPTIONS] -- COMMAND...",
        ),
    ],
)
def test_resolution_errors(argv: list[str], message: str, hint: str | None) -> None:
    with pytest.raises(SubmitError) as info:
        spec_of([*argv, "--", "true"])
    assert (info.value.message, info.value.hint) == (message, hint)


def test_errors_name_the_script_line() -> None:
    with pytest.raises(SubmitError) as info:
        spec_of(["job.sh"], "#!/bin/sh\n#TP --spares=many\n")
    assert info.value.message == (
        "the number of hot spares must be a whole number, got --spares=many (job.sh line 2)"
    )


def test_option_str() -> None:
    assert str(Option("nodes", "3", ("-N", "3"))) == "-N 3"
    assert str(Option("nodes", "3", ("-N3",), "j line 2")) == "-N3 (j line 2)"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--spares", "２"], "the number of hot spares must be a whole number, got --spares ２"),  # noqa: RUF001
        (["--spares", "²"], "the number of hot spares must be a whole number, got --spares ²"),
        (["-N", "３"], "-N ３: the node count must be a whole number, not '３'"),  # noqa: RUF001
        (
            ["--ntasks-per-node", "٤"],
            "the number of tasks per node must be a whole number, got --ntasks-per-node ٤",
        ),
    ],
    ids=["fullwidth-spares", "superscript-spares", "fullwidth-nodes", "arabic-indic-ntasks"],
)
def test_counts_are_ascii_digits(argv: list[str], message: str) -> None:
    """str.isdigit() and \\d take other scripts' digits ('²' even fails int()): counts are 0-9 only."""
    with pytest.raises(SubmitError) as info:
        spec_of([*argv, "--", "true"])
    assert info.value.message == message


# --- names that go into the batch script (issue 22) ------------------------------


@pytest.mark.parametrize(
    ("argv", "what"),
    [
        (["--job-name", "a\nb", "train.sh"], "the job name"),
        (["--supervisor-partition", "svc\n#SBATCH --uid=0", "train.sh"], "the supervisor's partition"),
        (["-p", "gpu\x1b[2J", "train.sh"], "the partition"),
        (["--output", "out\r.log", "train.sh"], "--output"),
        (["--comment", "x\ty", "train.sh"], "--comment"),
        (["--chdir", "/tmp/a\nb", "train.sh"], "--chdir"),
    ],
)
def test_a_control_character_in_a_name_is_refused(argv: list[str], what: str) -> None:
    with pytest.raises(SubmitError, match=f"^{what} .* holds the control character"):
        spec_of(argv, "#!/bin/bash\nsrun true\n")


def test_a_newline_in_the_scripts_path_never_reaches_the_rendered_script() -> None:
    request = parse_submit_args(["train.sh"])
    script = parse_batch_script("#!/bin/bash\nsrun true\n", "dir\nrm -rf ~/x\n/train.sh")
    with pytest.raises(SubmitError, match=r"^the script's path .* holds the control character"):
        resolve_job_spec(request, script, cwd="/home/u/proj", now=NOW)


@pytest.mark.parametrize(
    "argv",
    [
        ["--spares", "99999999999999999999", "train.sh"],
        ["-N", "999999", "--spares", "2", "train.sh"],
    ],
)
def test_a_node_count_beyond_any_cluster_is_refused(argv: list[str]) -> None:
    with pytest.raises(SubmitError, match="tp-submit allows at most 1,000,000"):
        spec_of(argv, "#!/bin/bash\nsrun true\n")


# --- --spare-wait (issue 24, item 3) ---------------------------------------------------------


def test_spare_wait_from_the_command_line_or_a_tp_line_is_exported_to_the_job() -> None:
    given = spec_of(["--spare-wait", "90", "--", "true"])
    from_line = spec_of(["job.sh"], "#!/bin/sh\n#TP --spare-wait=0\n#TP --spares=1\n")
    default = spec_of(["--", "true"])

    assert (given.spare_wait, from_line.spare_wait, default.spare_wait) == (90.0, 0.0, None)
    assert "export TORCHPASS_SPARE_WAIT=90\n" in render_batch_script(given)
    assert "export TORCHPASS_SPARE_WAIT=0\n" in render_batch_script(from_line)
    assert "TORCHPASS_SPARE_WAIT" not in render_batch_script(default)  # the setting's default applies
    assert not any("spare-wait" in a for a in sbatch_arguments(given))  # tp-submit's own, not sbatch's


@pytest.mark.parametrize("value", ["soon", "-5", "nan", "inf", "604801", ""])
def test_a_bad_spare_wait_is_refused_naming_where_it_came_from(value: str) -> None:
    with pytest.raises(SubmitError) as info:
        spec_of([f"--spare-wait={value}", "--", "true"])
    assert info.value.message == (
        f"--spare-wait={value!r} (from the command line) is not a number of seconds from 0 to 604800"
    )
    assert "--spare-wait 300" in (info.value.hint or "")
