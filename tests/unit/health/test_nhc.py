"""contrib/nhc/torchpass.nhc under bash, with NHC's die/log stubbed and a fake tp."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

MODULE = Path(__file__).resolve().parents[3] / "contrib" / "nhc" / "torchpass.nhc"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def nhc(tmp_path: Path, code: int, status: str, *, on_unknown: str = "log") -> tuple[int, str]:
    doc = {
        "status": status,
        "results": [
            {"check": "gpu_count", "status": "OK", "message": "fine"},
            {"check": "gpu_xid", "status": status, "message": "GPU 0: XID 79"},
        ],
    }
    fake = tmp_path / "tp"
    fake.write_text(f"#!/bin/sh\necho '{json.dumps(doc)}'\nexit {code}\n")
    fake.chmod(0o755)
    script = (
        f'die() {{ echo "DIE $*"; }}\nlog() {{ echo "LOG $*"; }}\n'
        f"TORCHPASS_TP={fake} TORCHPASS_PYTHON={sys.executable} TORCHPASS_NHC_ON_UNKNOWN={on_unknown}\n"
        f'. {MODULE}\ncheck_torchpass\necho "RC $?"\n'
    )
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    return proc.returncode, proc.stdout


def test_nhc_mapping(tmp_path: Path) -> None:
    assert nhc(tmp_path, 0, "OK")[1] == "RC 0\n"
    assert nhc(tmp_path, 1, "WARNING")[1] == "LOG torchpass: WARNING gpu_xid: GPU 0: XID 79\nRC 0\n"
    assert nhc(tmp_path, 2, "CRITICAL")[1] == "DIE 1 torchpass: gpu_xid: GPU 0: XID 79\nRC 1\n"
    assert nhc(tmp_path, 3, "UNKNOWN")[1] == (
        "LOG torchpass: check failed (exit 3), node not marked: gpu_xid: GPU 0: XID 79\nRC 0\n"
    )
    assert nhc(tmp_path, 3, "UNKNOWN", on_unknown="die")[1] == (
        "DIE 1 torchpass: check failed: gpu_xid: GPU 0: XID 79\nRC 1\n"
    )
