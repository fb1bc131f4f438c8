"""The tp-submit examples in docs/user-guide.md are what tp-submit prints.

Every console block after a ``<!-- checked-example -->`` marker is run (with a
fake Submitter, in a folder holding the guide's ``train.sbatch``) and its
output compared with the block, line for line.
"""

from __future__ import annotations

import re
import shlex
import textwrap
from pathlib import Path

import pytest

from torchpass_slurm.cli import submit as cli

from .test_cli import FakeSubmitter, tp_submit

GUIDE = Path(__file__).parents[3] / "docs" / "user-guide.md"
TEXT = GUIDE.read_text()
SCRIPT = re.search(r"<!-- example-script: train.sbatch -->\n```bash\n(.*?)```", TEXT, re.S)
EXAMPLES = [
    textwrap.dedent(block).splitlines()
    for block in re.findall(r"<!-- checked-example -->\n *```console\n(.*?)\n *```", TEXT, re.S)
]


def test_the_guide_has_checked_examples() -> None:
    assert SCRIPT is not None
    assert len(EXAMPLES) == 3


@pytest.mark.parametrize("lines", EXAMPLES, ids=[lines[0] for lines in EXAMPLES])
def test_example(lines: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert SCRIPT is not None
    monkeypatch.setattr(cli, "make_submitter", lambda: FakeSubmitter(partitions={"gpu": 8, "small": 2}))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SBATCH_PARTITION", raising=False)
    (tmp_path / "train.sbatch").write_text(SCRIPT.group(1))
    command, *expected = lines
    assert command.startswith("$ tp-submit ")
    result = tp_submit(*shlex.split(command)[2:])
    assert (result.out + result.err).splitlines() == expected
