"""A gathering child's helpers die with it, and none holds the hook's output open (issue 22).

A device library may fork a helper (a daemon, a probe). The hook must not leave it running
(as root, in a prolog), and must not leave it holding the hook's stdout: slurmd reads a
hook's output until its end, so the hook would seem to last as long as the helper.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.unit.processes import gone_within
from torchpass_slurm.health.child import Child


def _forks_a_helper(pidfile: Path, *, hang: bool) -> int:
    helper = subprocess.Popen(["sleep", "30"])
    pidfile.write_text(str(helper.pid))
    if hang:
        time.sleep(30)
    return 1


def test_a_helper_forked_by_a_child_that_answered_dies_with_it(tmp_path: Path) -> None:
    pidfile = tmp_path / "helper.pid"
    child = Child(lambda: _forks_a_helper(pidfile, hang=False), int, int, "the device source")
    assert child.result(time.monotonic() + 10) == 1
    assert gone_within(int(pidfile.read_text()), 5), "the helper outlived the child's answer"


def test_a_helper_forked_by_a_child_that_hung_dies_at_the_deadline(tmp_path: Path) -> None:
    pidfile = tmp_path / "helper.pid"
    child = Child(lambda: _forks_a_helper(pidfile, hang=True), int, int, "the device source")
    began = time.monotonic()
    try:
        child.result(time.monotonic() + 1.0)
    except TimeoutError:
        pass
    else:
        raise AssertionError("a hung child gave an answer")
    assert time.monotonic() - began < 5
    assert gone_within(int(pidfile.read_text()), 5), "the helper outlived the deadline"


def test_a_helper_that_left_the_group_does_not_hold_the_hooks_output(tmp_path: Path) -> None:
    """Even a helper in a session of its own (out of reach of the kill) has no hook output."""
    pidfile = tmp_path / "helper.pid"
    hook = textwrap.dedent(f"""
        import subprocess, time
        from pathlib import Path
        from torchpass_slurm.health.child import Child

        def gather():
            helper = subprocess.Popen(["setsid", "sleep", "30"])
            Path({str(pidfile)!r}).write_text(str(helper.pid))
            return 7

        print(Child(gather, int, int, "the device source").result(time.monotonic() + 10), flush=True)
    """)
    began = time.monotonic()
    out = subprocess.run([sys.executable, "-c", hook], capture_output=True, text=True, timeout=25)
    took = time.monotonic() - began
    assert out.stdout.strip() == "7", out
    assert took < 10, f"the hook's output stayed open {took:.1f} s: a helper held it"
    subprocess.run(["kill", "-9", pidfile.read_text()], check=False)
