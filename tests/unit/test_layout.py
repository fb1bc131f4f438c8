"""The package's layout, held by tests: no import cycle, the process boundaries, the sizes.

The folder a module lives in says which process runs it (docs/structure.md):
``supervisor/`` on the batch host, which may have no torch; ``rank/`` inside
every training process, which never talks to Slurm. These tests read the
package's sources with :mod:`ast` (nothing is imported) and build its import
graph:

* **Counted:** every import that runs when a module is imported: the module's
  top level, including ``if TYPE_CHECKING:`` blocks, other ``if`` / ``try``
  blocks and class bodies. A ``TYPE_CHECKING`` import is counted although it
  does not run: it is still a dependency, and a cycle through one is still a
  cycle to the reader and to mypy.
* **Not counted:** imports inside a function or method (lazy imports). They
  are the allowed way to reach a heavy or far-away module only when needed.
  Dynamic imports (``importlib.import_module``) are not seen either; the
  subprocess checks below catch what the static ones miss for the entry points.
* **Resolved:** ``import torchpass_slurm.a.b``, ``from torchpass_slurm.a import b``
  (an edge to the module ``a.b`` when ``b`` is one, else to the package ``a``),
  and relative imports (``from . import x``, ``from ..a import y``).
* **Parent packages:** importing ``a.b.c`` runs ``a/__init__.py`` and
  ``a/b/__init__.py`` first. The boundary checks follow those implicit imports
  too (their code really runs); the cycle check does not, because a package
  that re-exports its submodules would otherwise be a "cycle" with each of them.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PACKAGE = "torchpass_slurm"
PACKAGE_DIR = Path(__file__).resolve().parents[2] / PACKAGE

MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 300


# --- reading the package --------------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    """One counted import statement of a module: what it names, where."""

    target: str  # the full dotted name as resolved ("torch.distributed", "torchpass_slurm.slurm")
    line: int


@dataclass
class Module:
    name: str
    #: The file's path from the package's parent folder: "torchpass_slurm/submit/spec.py".
    relative: str
    is_package: bool
    source: str
    tree: ast.Module
    imports: list[Import] = field(default_factory=list)


def module_name(path: Path, root: Path, package: str) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def module_level_statements(body: Iterable[ast.stmt]) -> Iterator[ast.stmt]:
    """Every statement that runs at import time: into if/try/with/for/while and class bodies,
    never into a function's body."""
    for node in body:
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for name in ("body", "orelse", "finalbody"):
            yield from module_level_statements(getattr(node, name, ()))
        for handler in getattr(node, "handlers", ()):
            yield from module_level_statements(handler.body)
        for case in getattr(node, "cases", ()):  # match statements
            yield from module_level_statements(case.body)


def resolve_from(module: Module, node: ast.ImportFrom) -> str:
    """The absolute name of ``from X import ...`` (relative forms resolved against ``module``)."""
    if node.level == 0:
        return node.module or ""
    base = module.name.split(".")
    if not module.is_package:
        base.pop()  # a module's relative imports are against its package
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def read_package(root: Path, package: str) -> dict[str, Module]:
    """Every module under ``root`` (the folder of ``package``), with its counted imports."""
    modules: dict[str, Module] = {}
    for path in sorted(root.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        name = module_name(path, root, package)
        modules[name] = Module(
            name,
            path.relative_to(root.parent).as_posix(),
            path.name == "__init__.py",
            source,
            ast.parse(source, filename=str(path)),
        )
    for module in modules.values():
        for node in module_level_statements(module.tree.body):
            if isinstance(node, ast.Import):
                module.imports.extend(Import(alias.name, node.lineno) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = resolve_from(module, node)
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    target = submodule if submodule in modules else base
                    module.imports.append(Import(target, node.lineno))
    return modules


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int  # 0: the implicit import of a parent package

    def __str__(self) -> str:
        how = "(its parent package)" if self.line == 0 else f"(line {self.line})"
        return f"{self.source} -> {self.target} {how}"


def internal_target(name: str, modules: dict[str, Module]) -> str | None:
    """The package module an import of ``name`` loads: ``name`` or its longest known prefix."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def edges_of(module: Module, modules: dict[str, Module], *, with_parents: bool) -> list[Edge]:
    edges: list[Edge] = []
    for imp in module.imports:
        target = internal_target(imp.target, modules)
        if target is not None and target != module.name:
            edges.append(Edge(module.name, target, imp.line))
    if with_parents:
        parts = module.name.split(".")
        for i in range(len(parts) - 1, 0, -1):
            parent = ".".join(parts[:i])
            if parent in modules:
                edges.append(Edge(module.name, parent, 0))
    return edges


# --- the analyses (each also run on a small made-up package below) ----------------------------


def find_cycles(modules: dict[str, Module]) -> list[list[Edge]]:
    """One cycle per strongly connected group of modules (Tarjan), as the edges that close it."""
    graph = {name: edges_of(m, modules, with_parents=False) for name, m in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(name: str) -> None:  # recursion depth is bounded by the package's ~100 modules
        index[name] = low[name] = len(index)
        stack.append(name)
        on_stack.add(name)
        for edge in graph[name]:
            if edge.target not in index:
                visit(edge.target)
                low[name] = min(low[name], low[edge.target])
            elif edge.target in on_stack:
                low[name] = min(low[name], index[edge.target])
        if low[name] == index[name]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == name:
                    break
            if len(group) > 1:
                groups.append(group)

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return [cycle_in(group, graph) for group in groups]


def cycle_in(group: set[str], graph: dict[str, list[Edge]]) -> list[Edge]:
    """A shortest cycle through the group's first module (breadth-first, inside the group)."""
    start = min(group)
    came: dict[str, Edge] = {}
    queue = deque([start])
    while queue:
        name = queue.popleft()
        for edge in graph[name]:
            if edge.target not in group:
                continue
            if edge.target == start:
                path = [edge]
                while path[0].source != start:
                    path.insert(0, came[path[0].source])
                return path
            if edge.target not in came:
                came[edge.target] = edge
                queue.append(edge.target)
    raise AssertionError(f"no cycle in the strongly connected group {sorted(group)}")


def path_to(start: str, modules: dict[str, Module], bad: str) -> list[Edge] | None:
    """The shortest import chain from ``start`` to a module importing ``bad`` (a module name,
    package or external), or None. The last edge's target is ``bad`` itself."""

    def is_bad(name: str) -> bool:
        return name == bad or name.startswith(bad + ".")

    came: dict[str, Edge] = {}
    seen = {start}
    queue = deque([start])
    while queue:
        name = queue.popleft()
        module = modules[name]
        for imp in module.imports:
            if is_bad(imp.target):
                path = [Edge(name, imp.target, imp.line)]
                while path[0].source != start:
                    path.insert(0, came[path[0].source])
                return path
        for edge in edges_of(module, modules, with_parents=True):
            if edge.target not in seen:
                seen.add(edge.target)
                came[edge.target] = edge
                queue.append(edge.target)
    return None


def boundary_violations(modules: dict[str, Module], folder: str, bad: str) -> list[str]:
    """For every module in ``folder`` (a package name), the chain by which it reaches ``bad``."""
    found = []
    for name in sorted(modules):
        if name == folder or name.startswith(folder + "."):
            chain = path_to(name, modules, bad)
            if chain is not None:
                found.append(f"{name} imports {bad}:\n    " + "\n    ".join(map(str, chain)))
    return found


def long_modules(modules: dict[str, Module], limit: int) -> list[str]:
    return [
        f"{m.relative}: {len(m.source.splitlines())} lines"
        for m in modules.values()
        if len(m.source.splitlines()) > limit
    ]


def long_classes(modules: dict[str, Module], limit: int) -> list[str]:
    found = []
    for m in modules.values():
        for node in ast.walk(m.tree):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{m.name}.{node.name} (line {node.lineno}): {lines} lines")
    return found


# --- the package ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def package() -> dict[str, Module]:
    modules = read_package(PACKAGE_DIR, PACKAGE)
    assert f"{PACKAGE}.supervisor.loop" in modules and f"{PACKAGE}.rank.runtime" in modules
    return modules


def test_no_import_cycle(package: dict[str, Module]) -> None:
    cycles = find_cycles(package)
    shown = "\n\n".join("\n".join(f"  {edge}" for edge in cycle) for cycle in cycles)
    assert not cycles, (
        f"{len(cycles)} import cycle(s) among the package's modules (module-level imports, "
        f"TYPE_CHECKING ones included; a function-local import breaks a cycle):\n{shown}"
    )


def test_the_supervisor_never_imports_torch(package: dict[str, Module]) -> None:
    found = boundary_violations(package, f"{PACKAGE}.supervisor", "torch")
    assert not found, "the batch host may have no torch, but:\n" + "\n".join(found)


def test_the_rank_side_never_imports_the_slurm_layer(package: dict[str, Module]) -> None:
    found = boundary_violations(package, f"{PACKAGE}.rank", f"{PACKAGE}.slurm")
    assert not found, "training processes never talk to Slurm, but:\n" + "\n".join(found)


#: The ground floor: the vocabulary every process shares. A vocabulary module imports only
#: other vocabulary modules.
VOCABULARY = frozenset(
    {
        "config",
        "errors",
        "faults",
        "jsonsafe",
        "mesh",
        "ownership",
        "phase",
        "strenum",
    }
)

#: Which rooms each room may import (module-level imports, TYPE_CHECKING ones included), the
#: vocabulary aside. A folder's room is its name, a root module's is its name too. The
#: process folders stand side by side over the shared rooms (docs/structure.md, "Layers"):
#: ``rank/`` (inside the training) and ``supervisor/`` (the batch host) never meet; only the
#: CLI assembles, and only the public API ``train.py`` stands over ``rank/``.
ALLOWED_ROOMS: dict[str, frozenset[str]] = {
    "slurm": frozenset(),  # the one layer that runs Slurm commands
    "transfer": frozenset(),  # moving a state: manifest, chunks, transports
    "control": frozenset(),  # the wire: messages, bodies, the server and the client
    "rundir": frozenset({"slurm"}),  # the run folder's files (locate: a job id, via a backend)
    "health": frozenset({"slurm"}),  # node facts and checks, the prolog, the drains
    "submit": frozenset({"rundir"}),  # tp-submit's pure core: spec, options, the script
    "analysis": frozenset({"rundir"}),  # reports and goodput, read from run folders
    "rank": frozenset({"control", "transfer", "rundir", "health"}),  # health: its checks, run
    # by the node's agent thread in local rank 0
    "supervisor": frozenset({"control", "slurm", "rundir"}),
    "cli": frozenset({"slurm", "control", "rundir", "health", "submit", "analysis", "supervisor"}),
    "train": frozenset({"rank"}),  # the public API: a facade over the rank side
    "events": frozenset({"rundir"}),  # deprecated alias of rundir/events.py, for one release
}


def room_of(name: str) -> str:
    """``torchpass_slurm.rank.elastic`` -> ``rank``; ``torchpass_slurm.mesh`` -> ``mesh``."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def room_violations(modules: dict[str, Module]) -> list[str]:
    """Every module-level import from one room into another that the tables do not allow."""
    found = []
    for name, module in sorted(modules.items()):
        room = room_of(name)
        if not room:
            continue
        allowed = VOCABULARY if room in VOCABULARY else ALLOWED_ROOMS[room] | VOCABULARY
        for edge in edges_of(module, modules, with_parents=False):
            target = room_of(edge.target)
            if target and target != room and target not in allowed:
                found.append(f"{room} -> {target}: {edge}")
    return found


#: The Slurm client commands: only ``slurm/`` runs them (STYLE, habit 2).
SLURM_COMMANDS = frozenset(
    {
        "sacct",
        "sacctmgr",
        "salloc",
        "sattach",
        "sbatch",
        "sbcast",
        "scancel",
        "scontrol",
        "sinfo",
        "squeue",
        "srun",
        "sstat",
        "strigger",
    }
)
#: The modules outside ``slurm/`` that start a process, and why.
PROCESS_STARTERS = {
    f"{PACKAGE}.supervisor.store_host": "the job's rendezvous store, a Python child of tp run",
    f"{PACKAGE}.transfer.mpi_process": "a transfer's MPI helper: MPICH's mpiexec -n 1 on the rank's node",
}
_STARTS_A_PROCESS = {
    "subprocess": {"run", "Popen", "call", "check_call", "check_output"},
    "os": {
        "system",
        "popen",
        "execv",
        "execvp",
        "execvpe",
        "execl",
        "execlp",
        "spawnv",
        "spawnvp",
        "posix_spawn",
        "posix_spawnp",
    },
}


def process_starts(module: Module) -> list[int]:
    """The lines where ``module`` starts a process (``subprocess.run(...)``, ``os.execvp(...)``)."""
    return sorted(
        node.lineno
        for node in ast.walk(module.tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.attr in _STARTS_A_PROCESS.get(node.func.value.id, ())
    )


def slurm_command_names(module: Module) -> list[int]:
    """The lines where ``module`` spells a Slurm command as a string of its own (``"scancel"``)."""
    return sorted(
        node.lineno
        for node in ast.walk(module.tree)
        if isinstance(node, ast.Constant) and node.value in SLURM_COMMANDS
    )


def test_every_room_imports_only_the_rooms_below_it(package: dict[str, Module]) -> None:
    rooms = {room_of(name) for name in package} - {""}
    assert rooms <= set(ALLOWED_ROOMS) | VOCABULARY, (
        f"rooms missing from ALLOWED_ROOMS or VOCABULARY: {sorted(rooms - set(ALLOWED_ROOMS) - VOCABULARY)}"
    )
    found = room_violations(package)
    assert not found, "imports the layer tables do not allow:\n  " + "\n  ".join(found)


def test_only_the_slurm_layer_runs_slurm_commands(package: dict[str, Module]) -> None:
    found = []
    for name, module in sorted(package.items()):
        if room_of(name) == "slurm":
            continue
        starts = process_starts(module)
        if starts and name not in PROCESS_STARTERS:
            found.append(f"{module.relative} starts a process (lines {starts}); only slurm/ should")
        if starts and slurm_command_names(module):
            found.append(
                f"{module.relative} starts a process and names a Slurm command "
                f"(lines {slurm_command_names(module)}): run it through slurm/"
            )
    assert not found, "\n".join(found)
    assert set(PROCESS_STARTERS) <= set(package), "PROCESS_STARTERS names a module that is gone"


@pytest.mark.parametrize("entry_point", [f"{PACKAGE}.supervisor.loop", f"{PACKAGE}.cli.run"])
def test_the_batch_host_entry_points_leave_torch_unloaded(entry_point: str) -> None:
    code = textwrap.dedent(f"""
        import sys
        import {entry_point}
        if "torch" in sys.modules:
            loaded = sorted(m for m in sys.modules if m.startswith("{PACKAGE}."))
            sys.exit("torch was imported; the package's modules loaded: " + ", ".join(loaded))
    """)
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=PACKAGE_DIR.parent,
        check=False,
    )
    assert done.returncode == 0, f"import {entry_point}: {done.stderr.strip()}"


def test_no_module_is_over_500_lines(package: dict[str, Module]) -> None:
    found = long_modules(package, MAX_MODULE_LINES)
    assert not found, f"modules over {MAX_MODULE_LINES} lines (split by concept):\n  " + "\n  ".join(found)


def test_no_class_is_over_300_lines(package: dict[str, Module]) -> None:
    found = long_classes(package, MAX_CLASS_LINES)
    assert not found, f"classes over {MAX_CLASS_LINES} lines:\n  " + "\n  ".join(found)


# --- the analyses find what they should: a made-up package -------------------------------------


def make_package(root: Path, files: dict[str, str]) -> dict[str, Module]:
    for relative, text in files.items():
        path = root / "pkg" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return read_package(root / "pkg", "pkg")


def test_a_cycle_through_a_relative_and_a_type_checking_import_is_found(tmp_path: Path) -> None:
    modules = make_package(
        tmp_path,
        {
            "__init__.py": "",
            "sup/__init__.py": "from pkg.sup.loop import Loop\n",  # re-exports: not a cycle
            "sup/loop.py": "from .recovery import Mixin\nclass Loop(Mixin): ...\n",
            "sup/recovery.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from pkg.sup import loop\nclass Mixin: ...\n",
            "lazy/a.py": "def f():\n    from pkg.lazy import b\n",
            "lazy/b.py": "from pkg.lazy import a\n",
        },
    )
    [cycle] = find_cycles(modules)
    assert [str(edge) for edge in cycle] == [
        "pkg.sup.loop -> pkg.sup.recovery (line 1)",
        "pkg.sup.recovery -> pkg.sup.loop (line 3)",
    ]


def test_a_transitive_boundary_crossing_is_shown_as_its_chain(tmp_path: Path) -> None:
    modules = make_package(
        tmp_path,
        {
            "__init__.py": "",
            "sup/__init__.py": "",
            "sup/loop.py": "from ..transfer import plan\n",
            "transfer/__init__.py": "from . import gpu\n",  # runs when transfer.plan is imported
            "transfer/plan.py": "def later():\n    import torch\n",
            "transfer/gpu.py": "import torch.distributed as dist\n",
            "rank/__init__.py": "",
            "rank/step.py": "class Step:\n    from pkg.slurm.steps import srun  # a class body runs\n",
            "rank/lazy.py": "def f():\n    from pkg import slurm\n",
            "slurm/__init__.py": "",
            "slurm/steps.py": "srun = 1\n",
        },
    )
    assert boundary_violations(modules, "pkg.sup", "torch") == [
        (
            "pkg.sup.loop imports torch:\n"
            "    pkg.sup.loop -> pkg.transfer.plan (line 1)\n"
            "    pkg.transfer.plan -> pkg.transfer (its parent package)\n"
            "    pkg.transfer -> pkg.transfer.gpu (line 1)\n"
            "    pkg.transfer.gpu -> torch.distributed (line 1)"
        )
    ]
    assert boundary_violations(modules, "pkg.rank", "pkg.slurm") == [
        "pkg.rank.step imports pkg.slurm:\n    pkg.rank.step -> pkg.slurm.steps (line 2)"
    ]


def test_long_modules_and_classes_are_found(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(5))
    modules = make_package(tmp_path, {"__init__.py": "", "big.py": f"class Big:\n{body}\n"})
    assert long_modules(modules, 5) == ["pkg/big.py: 6 lines"]
    assert long_classes(modules, 5) == ["pkg.big.Big (line 1): 6 lines"]
    assert long_modules(modules, 6) == [] and long_classes(modules, 6) == []


def test_an_import_between_rooms_side_by_side_is_found_and_a_lazy_one_is_not(tmp_path: Path) -> None:
    modules = make_package(
        tmp_path,
        {
            "__init__.py": "",
            "mesh.py": "",
            "rank/__init__.py": "",
            "rank/trainer.py": "from pkg import mesh\n",
            "supervisor/__init__.py": "",
            "supervisor/plan.py": "from pkg.rank.trainer import x\nfrom pkg import mesh\n",
            "supervisor/lazy.py": "def f():\n    from pkg.rank import trainer\n",
        },
    )
    assert room_violations(modules) == [
        "supervisor -> rank: pkg.supervisor.plan -> pkg.rank.trainer (line 1)"
    ]


def test_a_slurm_command_started_outside_the_slurm_layer_is_found(tmp_path: Path) -> None:
    modules = make_package(
        tmp_path,
        {
            "__init__.py": "",
            "cancel.py": "import subprocess\n\ndef cancel(job):\n    argv = ['scancel', job]\n"
            "    subprocess.run(argv, check=True)\n",
            "render.py": "import shlex\n\ndef line():\n    return shlex.join(['sbatch', 'x'])\n",
        },
    )
    assert process_starts(modules["pkg.cancel"]) == [5]
    assert slurm_command_names(modules["pkg.cancel"]) == [4]
    assert process_starts(modules["pkg.render"]) == []  # a rendered command is not a started one
