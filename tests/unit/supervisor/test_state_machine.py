"""The job's run-state machine is a table (``RUN_STATE_MACHINE``), and ``JobState.enter`` is the
only way the run state changes."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

from torchpass_slurm.supervisor.membership import Membership
from torchpass_slurm.supervisor.state import RUN_STATE_MACHINE, JobState, RunState

SUPERVISOR_DIR = Path(__file__).resolve().parents[3] / "torchpass_slurm" / "supervisor"
LIVE = (RunState.LAUNCHING, RunState.RUNNING, RunState.RECOVERING)


def job_in(state: RunState) -> JobState:
    job = JobState(job_id=7, membership=Membership.initial(["c1", "c2", "c3"], 2, 1))
    job.state = state  # the test sets the start directly; the package never does
    return job


@pytest.mark.parametrize(("start", "end"), list(itertools.product(RunState, RunState)))
def test_enter_takes_exactly_the_transitions_of_the_table(start: RunState, end: RunState) -> None:
    job = job_in(start)
    staying = start == end and start in (RunState.LAUNCHING, RunState.RUNNING)
    if (start, end) in RUN_STATE_MACHINE or staying:
        job.enter(end)
        assert job.state == end
    else:
        with pytest.raises(RuntimeError, match=f"no transition from {start} to {end}"):
            job.enter(end)
        assert job.state == start


def test_the_table_reaches_every_state_and_an_ended_job_never_moves() -> None:
    assert {end for _, end in RUN_STATE_MACHINE} == set(RunState)
    assert not [pair for pair in RUN_STATE_MACHINE if pair[0].ended]
    for state in LIVE:  # from every live state the job can fail, succeed or recover
        assert {(state, RunState.FAILED), (state, RunState.SUCCEEDED), (state, RunState.RECOVERING)} <= set(
            RUN_STATE_MACHINE
        )


def run_state_writes(tree: ast.Module) -> list[int]:
    """Lines that assign ``<something>.job.state`` or ``job.state`` (alone or in a tuple)."""
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            for target in node.targets:
                targets.extend(target.elts if isinstance(target, ast.Tuple) else [target])
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets.append(node.target)
        for target in targets:
            if not (isinstance(target, ast.Attribute) and target.attr == "state"):
                continue
            owner = target.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name == "job":
                found.append(target.lineno)
    return found


def test_only_the_state_module_writes_the_run_state() -> None:
    writes = {
        path.name: lines
        for path in sorted(SUPERVISOR_DIR.glob("*.py"))
        if path.name != "state.py" and (lines := run_state_writes(ast.parse(path.read_text())))
    }
    assert writes == {}, f"run state written outside JobState.enter: {writes}"


def test_the_write_finder_sees_a_plain_and_a_tuple_write() -> None:
    tree = ast.parse("self.job.state = 1\njob.state, x = 2, 3\nstep.state = 4\n")
    assert run_state_writes(tree) == [1, 2]
