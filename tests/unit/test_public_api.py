"""The public API (``torchpass_slurm.train``): every name resolves to the internal object, and
importing the package stays light."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import torchpass_slurm.train as train

ROOT = Path(__file__).resolve().parents[2]

#: Each public name and the internal object it stands for ("module:attribute", or a module).
INTERNAL = {
    "init": "torchpass_slurm.rank.runtime:init",
    "Runtime": "torchpass_slurm.rank.runtime:Runtime",
    "Role": "torchpass_slurm.rank.rankinfo:Role",
    "RankInfo": "torchpass_slurm.rank.rankinfo:RankInfo",
    "ElasticTrainer": "torchpass_slurm.rank.elastic:ElasticTrainer",
    "ShardedTrainer": "torchpass_slurm.rank.sharded:ShardedTrainer",
    "MeshLayout": "torchpass_slurm.mesh:MeshLayout",
    "checkpoint": "torchpass_slurm.rank.checkpoint",
    "TrainState": "torchpass_slurm.rank.checkpoint:TrainState",
    "RNGState": "torchpass_slurm.rank.checkpoint:RNGState",
    "leave": "torchpass_slurm.rank.group:leave",
}


def internal(where: str) -> object:
    module, _, attribute = where.partition(":")
    found = importlib.import_module(module)
    return getattr(found, attribute) if attribute else found


def test_all_is_the_documented_list_without_duplicates() -> None:
    assert len(set(train.__all__)) == len(train.__all__)
    assert sorted(train.__all__) == sorted(INTERNAL)


@pytest.mark.parametrize("name", sorted(INTERNAL))
def test_every_public_name_is_the_internal_object(name: str) -> None:
    assert getattr(train, name) is internal(INTERNAL[name])


def test_star_import_gives_exactly_all() -> None:
    namespace: dict[str, object] = {}
    exec("from torchpass_slurm.train import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == sorted(train.__all__)


def test_checkpoint_keeps_its_documented_functions() -> None:
    for name in ("save", "load_latest", "latest_step", "TrainState", "RNGState"):
        assert name in train.checkpoint.__all__ and callable(getattr(train.checkpoint, name))


def imports_torch(statement: str) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(f"""
        import sys
        {statement}
        if "torch" in sys.modules:
            loaded = sorted(m for m in sys.modules if m.startswith("torchpass_slurm"))
            sys.exit("torch was imported; the package's modules loaded: " + ", ".join(loaded))
    """)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT, check=False
    )


def test_importing_the_package_leaves_torch_unloaded() -> None:
    done = imports_torch("import torchpass_slurm")
    assert done.returncode == 0, done.stderr.strip()


def test_importing_the_public_api_leaves_torch_unloaded() -> None:
    """train.py imports its targets directly because none of them imports torch at import time;
    if this fails, make train.py import lazily (a module ``__getattr__``) or fix the target."""
    done = imports_torch("import torchpass_slurm.train")
    assert done.returncode == 0, done.stderr.strip()


def test_leave_exits_with_its_code_and_loses_no_output(tmp_path: Path) -> None:
    """``leave`` skips the interpreter's shutdown: what was printed and logged still comes out,
    and nothing registered to run at exit does."""
    script = textwrap.dedent("""
        import atexit, logging, sys
        from torchpass_slurm.train import leave
        logging.basicConfig(filename=sys.argv[1], level=logging.INFO)
        atexit.register(lambda: print("atexit ran"))
        print("unterminated", end="")
        logging.info("logged before leaving")
        leave(3)
        print("after leave")
    """)
    log = tmp_path / "log"
    done = subprocess.run(
        [sys.executable, "-c", script, str(log)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout) == (3, "unterminated"), done.stderr
    assert "logged before leaving" in log.read_text()


#: The call signatures training scripts use (sbatch-examples/, docs/user-guide-training.md):
#: (name, kind) of every parameter, in order. A trainer's internals may change; these may not.
SIGNATURES = {
    "ElasticTrainer": [
        ("rt", "POSITIONAL_OR_KEYWORD"),
        ("model", "POSITIONAL_OR_KEYWORD"),
        ("optimizer", "POSITIONAL_OR_KEYWORD"),
        ("state", "KEYWORD_ONLY"),
        ("scheduler", "KEYWORD_ONLY"),
        ("backend", "KEYWORD_ONLY"),
        ("ddp_kwargs", "KEYWORD_ONLY"),
        ("start_step", "KEYWORD_ONLY"),
        ("rank_state", "KEYWORD_ONLY"),
    ],
    "ShardedTrainer": [
        ("rt", "POSITIONAL_OR_KEYWORD"),
        ("build", "POSITIONAL_OR_KEYWORD"),
        ("layout", "POSITIONAL_OR_KEYWORD"),
        ("backend", "KEYWORD_ONLY"),
        ("device_type", "KEYWORD_ONLY"),
        ("start_step", "KEYWORD_ONLY"),
        ("rank_state", "KEYWORD_ONLY"),
    ],
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_the_trainers_keep_their_call_signatures(name: str) -> None:
    parameters = inspect.signature(getattr(train, name)).parameters.values()
    assert [(p.name, p.kind.name) for p in parameters] == SIGNATURES[name]


def test_both_trainers_are_the_one_trainer_class() -> None:
    """``ShardedTrainer`` builds the same ``ElasticTrainer`` with a sharded state injected."""
    assert inspect.signature(train.ShardedTrainer).return_annotation == "ElasticTrainer"


@pytest.mark.parametrize(
    ("old", "new", "name"),
    [
        ("torchpass_slurm.rank.layout", "torchpass_slurm.mesh", "MeshLayout"),
        ("torchpass_slurm.events", "torchpass_slurm.rundir.events", "EventLog"),
    ],
)
def test_a_moved_module_keeps_its_old_path_for_one_release_with_a_warning(
    old: str, new: str, name: str
) -> None:
    """The old import path still gives the same object, and says where it went."""
    code = (
        "import importlib, warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    old = importlib.import_module({old!r})\n"
        f"assert getattr(old, {name!r}) is getattr(importlib.import_module({new!r}), {name!r})\n"
        "print([str(w.message) for w in caught if w.category is DeprecationWarning])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert f"{old} is deprecated and goes in the next release" in done.stdout
