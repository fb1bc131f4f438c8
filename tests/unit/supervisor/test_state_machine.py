"""The job's run-state machine is a table (``RUN_STATE_MACHINE``), ``JobState.enter`` is the only
way the run state changes, and the job's record has one owner: only ``state.py`` writes a field of
``JobState`` or of its ``Migration``, and only ``workers.py`` a step's state."""

from __future__ import annotations

import ast
import dataclasses
import itertools
from pathlib import Path

import pytest

from torchpass_slurm.supervisor.membership import Membership
from torchpass_slurm.supervisor.state import RUN_STATE_MACHINE, JobState, Migration, RunState

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


def assigned(node: ast.AST) -> list[ast.expr]:
    """The targets ``node`` assigns, a tuple's elements one by one (none for other nodes)."""
    if isinstance(node, ast.Assign):
        return [e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    return []


def run_state_writes(tree: ast.Module) -> list[int]:
    """Lines that assign ``<something>.job.state`` or ``job.state`` (alone or in a tuple)."""
    found = []
    for node in ast.walk(tree):
        for target in assigned(node):
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


JOB_FIELDS = {f.name for f in dataclasses.fields(JobState)}
MIGRATION_FIELDS = {f.name for f in dataclasses.fields(Migration)}
#: methods that change a set, a list or a dict in place
MUTATORS = {"add", "discard", "update", "remove", "pop", "clear", "append", "extend", "difference_update"}


def chain(expr: ast.expr) -> list[str]:
    """The names of an attribute chain from its root: ``self.job.steps[n].state`` ->
    ``["self", "job", "steps", "state"]`` (subscripts and calls are stepped through)."""
    names: list[str] = []
    while True:
        if isinstance(expr, ast.Attribute):
            names.append(expr.attr)
            expr = expr.value
        elif isinstance(expr, (ast.Subscript, ast.Call)):
            expr = expr.value if isinstance(expr, ast.Subscript) else expr.func
        else:
            names.append(getattr(expr, "id", "?"))
            return names[::-1]


def writes_the_record(names: list[str]) -> bool:
    """``names`` (a written chain) reaches into the job's record: ``job.<field>``,
    ``migration.<field>``, or a field of ``mig`` (the name the package gives the migration)."""
    pairs = list(itertools.pairwise(names))
    return any(
        (a == "job" and b in JOB_FIELDS) or (a in ("migration", "mig") and b in MIGRATION_FIELDS)
        for a, b in pairs
    )


def record_writes(tree: ast.Module) -> list[int]:
    """Lines that assign into the job's record, or change one of its collections in place."""
    found = []
    for node in ast.walk(tree):
        written = assigned(node)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            written.append(node.func.value)
        found.extend(t.lineno for t in written if writes_the_record(chain(t)))
    return sorted(set(found))


def step_state_writes(tree: ast.Module) -> list[int]:
    """Lines that assign a ``WorkerState`` to something's ``state``."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Attribute) and t.attr == "state" for t in node.targets)
        and chain(node.value)[:1] == ["WorkerState"]
    ]


def test_only_the_state_module_writes_the_jobs_record() -> None:
    writes = {
        path.name: lines
        for path in sorted(SUPERVISOR_DIR.glob("*.py"))
        if path.name != "state.py" and (lines := record_writes(ast.parse(path.read_text())))
    }
    assert writes == {}, f"the job's record written outside JobState's methods: {writes}"


def test_only_the_workers_module_writes_a_steps_state() -> None:
    writes = {
        path.name: lines
        for path in sorted(SUPERVISOR_DIR.glob("*.py"))
        if path.name != "workers.py" and (lines := step_state_writes(ast.parse(path.read_text())))
    }
    assert writes == {}, f"a step's state written outside WorkerStep: {writes}"


def test_the_record_write_finder_sees_each_way_of_writing() -> None:
    source = (
        "self.job.migration = None\n"  # 1: a field
        "job.migration.agreed = 3\n"  # 2: a migration's field
        "mig.left = True\n"  # 3: through the local name
        "self.job.releasing.add(n)\n"  # 4: a set changed in place
        "job.steps[n] = s\n"  # 5: a dict's item
        "job.restarts += 1\n"  # 6: counted up
        "self.job.exit_code, self.job.message = 1, ''\n"  # 7: in a tuple
        "self.jobs = []\n"  # 8: not the record
        "x = job.migration.agreed\n"  # 9: a read
        "self.releasing.add(n)\n"  # 10: another object's set
    )
    assert record_writes(ast.parse(source)) == [1, 2, 3, 4, 5, 6, 7]
    steps = ast.parse("step.state = WorkerState.LOST\nself.state = RunState.RUNNING\n")
    assert step_state_writes(steps) == [1]
