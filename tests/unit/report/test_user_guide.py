"""The legend of `tp report --explain` is the one docs/user-guide.md shows."""

from __future__ import annotations

import re
from pathlib import Path

from torchpass_slurm.cli.report import LEGEND

GUIDE = Path(__file__).parents[3] / "docs" / "user-guide.md"


def test_the_guide_quotes_the_legend() -> None:
    quote = re.search(r"<!-- tp-report-legend -->\n((?:> .*\n)+)", GUIDE.read_text())
    assert quote is not None, "docs/user-guide.md lost its <!-- tp-report-legend --> quote"
    text = " ".join(line.removeprefix("> ") for line in quote.group(1).splitlines())
    assert text == LEGEND
