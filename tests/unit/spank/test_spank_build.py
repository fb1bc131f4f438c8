"""The torchpass SPANK plugin (spank/): its Makefile, unit test, exports and job_submit.lua.

These tests build in a copy of spank/ (the source tree stays clean). They need
gcc and make; the plugin itself also needs Slurm's headers (slurm/spank.h from
libslurm-dev, or SLURM_INCLUDE_DIR); the job_submit.lua tests need a Lua 5.1
interpreter. Whatever is missing is skipped with the reason shown.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SPANK_DIR = Path(__file__).resolve().parents[3] / "spank"
SLURM_INCLUDE_DIR = os.environ.get("SLURM_INCLUDE_DIR", "/usr/include")

#: What torchpass.so may export: the callbacks and what SPANK_PLUGIN() defines.
ALLOWED_EXPORTS = {"plugin_name", "plugin_type", "plugin_version", "spank_plugin_version"}
REQUIRED_EXPORTS = ALLOWED_EXPORTS | {"slurm_spank_init", "slurm_spank_init_post_opt"}


def _missing_tools(*tools: str) -> list[str]:
    return [t for t in tools if shutil.which(t) is None]


def _skip_without(*tools: str) -> None:
    missing = _missing_tools(*tools)
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (needed to build spank/)")


def _skip_without_spank_h() -> None:
    header = Path(SLURM_INCLUDE_DIR) / "slurm" / "spank.h"
    if not header.is_file():
        pytest.skip(f"{header} not found: install libslurm-dev or set SLURM_INCLUDE_DIR")


def _make(build_dir: Path, *targets: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "-C", str(build_dir), f"SLURM_INCLUDE_DIR={SLURM_INCLUDE_DIR}", *targets],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _copy_sources(dest: Path) -> Path:
    build_dir = dest / "spank"
    shutil.copytree(SPANK_DIR, build_dir, ignore=shutil.ignore_patterns("*.o", "*.so", "test_config"))
    return build_dir


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """spank/ copied and built with `make check` (unit test + symbol check)."""
    _skip_without("gcc", "make", "nm")
    _skip_without_spank_h()
    build_dir = _copy_sources(tmp_path_factory.mktemp("spank-build"))
    proc = _make(build_dir, "check")
    assert proc.returncode == 0, f"make check failed:\n{proc.stdout}\n{proc.stderr}"
    assert "checks passed" in proc.stdout
    assert "torchpass.so exports only:" in proc.stdout
    return build_dir


def test_config_unit_test_needs_no_slurm(tmp_path: Path) -> None:
    _skip_without("gcc", "make")
    build_dir = _copy_sources(tmp_path)
    proc = _make(build_dir, "check-unit")
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert "torchpass: test_config:" in proc.stdout and "checks passed" in proc.stdout


def test_make_check_builds_and_passes(built: Path) -> None:
    assert (built / "torchpass.so").is_file()


def test_plugin_exports_only_spank_symbols(built: Path) -> None:
    out = subprocess.run(
        ["nm", "-D", "--defined-only", str(built / "torchpass.so")],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    exported = {line.split()[-1] for line in out.splitlines() if len(line.split()) >= 3}
    unexpected = {s for s in exported if s not in ALLOWED_EXPORTS and not s.startswith("slurm_spank_")}
    assert not unexpected, f"torchpass.so exports more than the version script allows: {unexpected}"
    assert REQUIRED_EXPORTS <= exported, f"missing exports: {REQUIRED_EXPORTS - exported}"


def test_plugin_is_linked_with_relro_and_bind_now(built: Path) -> None:
    _skip_without("readelf")
    so = str(built / "torchpass.so")
    headers = subprocess.run(
        ["readelf", "-lW", so], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    dynamic = subprocess.run(
        ["readelf", "-dW", so], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert "GNU_RELRO" in headers
    assert "BIND_NOW" in dynamic or "NOW" in dynamic


def test_make_install_puts_plugin_and_examples_under_prefix(built: Path, tmp_path: Path) -> None:
    proc = _make(built, "install", f"DESTDIR={tmp_path}", "PREFIX=/opt/tp")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "opt/tp/lib/slurm/torchpass.so").is_file()
    assert (tmp_path / "opt/tp/share/torchpass-slurm/job_submit.lua").is_file()
    assert (tmp_path / "opt/tp/share/torchpass-slurm/plugstack.conf.example").is_file()


# --- job_submit.lua, run by a Lua 5.1 interpreter against a fake `slurm` table ---

LUA = next((t for t in ("lua5.1", "lua") if shutil.which(t)), None)

_FAKE_SLURM = """
slurm = { SUCCESS = 0, ERROR = -1, NO_VAL = 4294967294, NO_VAL16 = 65534 }
messages = {}
function slurm.log_user(fmt, ...) table.insert(messages, string.format(fmt, ...)) end
function slurm.log_info(fmt, ...) end
dofile(%r)
"""


def _run_lua(job_desc: str) -> tuple[int, str, str]:
    """Call slurm_job_submit on ``job_desc`` (a Lua table constructor).

    Returns (rc, "min_nodes max_nodes num_tasks" after the call, user messages).
    """
    if LUA is None:
        pytest.skip("no Lua interpreter (apt-get install lua5.1) to run job_submit.lua")
    program = (
        _FAKE_SLURM % str(SPANK_DIR / "job_submit.lua")
        + f"""
local job = {job_desc}
local rc = slurm_job_submit(job, {{}}, 1000)
print(rc)
print(tostring(job.min_nodes) .. " " .. tostring(job.max_nodes) .. " " .. tostring(job.num_tasks))
print(table.concat(messages, " | "))
"""
    )
    proc = subprocess.run([LUA, "-"], input=program, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rc, nodes, messages = [*proc.stdout.split("\n"), "", "", ""][:3]
    return int(rc), nodes, messages


def test_lua_adds_spares_to_the_node_count() -> None:
    rc, nodes, messages = _run_lua(
        '{ min_nodes = 4, max_nodes = 4, spank_job_env = { [0] = "TORCHPASS_SPARES=2" } }'
    )
    assert (rc, nodes) == (0, "6 6 nil")
    assert messages == "torchpass: 4 node(s) + 2 hot spare(s) = 6 nodes"


def test_lua_without_n_counts_one_node_and_scales_counted_tasks() -> None:
    rc, nodes, _ = _run_lua(
        "{ min_nodes = 4294967294, max_nodes = 4294967294, num_tasks = 2, ntasks_per_node = 2,"
        ' spank_job_env = { [0] = "OTHER=1", [1] = "TORCHPASS_SPARES=1" } }'
    )
    assert (rc, nodes) == (0, "2 4294967294 4")


def test_lua_leaves_jobs_without_spares_and_tp_submit_jobs_alone() -> None:
    assert _run_lua("{ min_nodes = 3 }")[:2] == (0, "3 nil nil")
    assert _run_lua('{ min_nodes = 3, spank_job_env = { [0] = "TORCHPASS_SPARES=0" } }')[:2] == (
        0,
        "3 nil nil",
    )
    tp_submit_job = (
        '{ min_nodes = 3, spank_job_env = { [0] = "TORCHPASS_SPARES=1" },'
        ' script = "#!/bin/bash\\n# Rendered by tp-submit\\n'
        'export TORCHPASS_NODES=2\\n" }'
    )
    assert _run_lua(tp_submit_job)[:2] == (0, "3 nil nil")


def test_lua_refuses_values_the_spank_plugin_should_have_stopped() -> None:
    rc, nodes, messages = _run_lua('{ min_nodes = 2, spank_job_env = { [0] = "TORCHPASS_SPARES=500" } }')
    assert (rc, nodes) == (-1, "2 nil nil")
    assert messages == "torchpass: 500 spare nodes asked for, this cluster allows at most 64"
    rc, _, messages = _run_lua('{ min_nodes = 2, spank_job_env = { [0] = "TORCHPASS_SPARES=x" } }')
    assert rc == -1 and messages == "torchpass: TORCHPASS_SPARES=x is not a number of spare nodes"
