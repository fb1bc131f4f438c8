"""poll_until, and that the new commands keep `tp --help` free of rich."""

from __future__ import annotations

import subprocess
import sys

from torchpass_slurm.cli.poll import poll_until


def test_poll_until_done() -> None:
    answers = iter([False, False, True])
    calls = []
    poll_until(lambda: calls.append(1) or next(answers), 0.0)
    assert len(calls) == 3


def test_ctrl_c_ends_polling_quietly() -> None:
    def step() -> bool:
        raise KeyboardInterrupt

    poll_until(step, 0.0)  # returns, does not raise


def test_importing_the_commands_does_not_import_rich() -> None:
    code = (
        "import sys, torchpass_slurm.cli.status, torchpass_slurm.cli.events; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('rich', 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out == "[]\n"
