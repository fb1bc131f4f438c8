"""The user guide's table of the supervisor's settings names every one of them, with its default."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from torchpass_slurm.config import SupervisorConfig

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "user-guide.md"


def test_every_setting_is_in_the_user_guide_with_its_default() -> None:
    rows = dict(re.findall(r"^\| `(TORCHPASS_[A-Z_]+)` \| ([^|]+) \|", GUIDE.read_text(), re.MULTILINE))
    for f in dataclasses.fields(SupervisorConfig):
        name = f"TORCHPASS_{f.name.upper()}"
        assert name in rows, f"{name} is missing from {GUIDE.name}'s settings table"
        shown = float(rows[name].strip().removesuffix(" s"))
        assert shown == f.default, f"{name}: the guide says {rows[name].strip()}, the code {f.default}"
