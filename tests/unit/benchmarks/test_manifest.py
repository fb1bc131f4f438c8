"""benchmarks/results/MANIFEST.json names every result file, and the writers keep it so."""

from __future__ import annotations

import json
import re
from pathlib import Path

from benchmarks import manifest

DOC = manifest.ROOT / "docs" / "benchmarks.md"
FIELDS = ("command", "commit", "committed_in", "date", "host")
#: Result files docs/benchmarks.md names that live in git history only ("Earlier numbers").
IN_HISTORY = {"recovery.json"}


def entries() -> dict[str, dict]:
    return manifest.load()["files"]


def test_every_result_file_has_an_entry_and_every_entry_a_file() -> None:
    on_disk = {p.name for p in manifest.RESULTS.iterdir() if p.is_file() and p != manifest.MANIFEST}
    assert on_disk - set(entries()) == set(), "result files missing from MANIFEST.json"
    assert set(entries()) - on_disk == set(), "MANIFEST.json entries without a file"


def test_every_entry_says_command_commit_date_and_host() -> None:
    for name, entry in entries().items():
        for field in FIELDS:
            assert isinstance(entry.get(field), str) and entry[field], (name, field)
        assert isinstance(entry.get("current_for"), list), name


def test_current_for_names_headings_of_the_benchmarks_page() -> None:
    headings = set(re.findall(r"^#+ (.+)$", DOC.read_text(), re.M))
    for name, entry in entries().items():
        assert set(entry["current_for"]) <= headings, name


def test_every_result_file_the_page_names_is_in_the_manifest() -> None:
    named = set(re.findall(r"benchmarks/results/([\w.-]+\.json)", DOC.read_text()))
    assert named - IN_HISTORY - {manifest.MANIFEST.name} - set(entries()) == set()


def test_a_writer_stamps_its_result_and_adds_its_entry(tmp_path: Path) -> None:
    book = tmp_path / "MANIFEST.json"
    book.write_text(json.dumps({"files": {"old.json": {"current_for": ["Results"]}}}))
    manifest.write_result(tmp_path / "new.json", {"x": 1}, manifest=book)
    manifest.write_result(tmp_path / "old.json", {"x": 2}, manifest=book)

    stamp = json.loads((tmp_path / "new.json").read_text())["provenance"]
    assert set(stamp) == {"command", "commit", "date", "host"}
    files = manifest.load(book)["files"]
    assert files["new.json"]["command"] == stamp["command"]
    assert files["new.json"]["current_for"] == []
    assert files["old.json"]["current_for"] == ["Results"]  # a rerun keeps what the page cites


def test_a_result_written_elsewhere_is_not_recorded(tmp_path: Path) -> None:
    book = tmp_path / "results" / "MANIFEST.json"
    book.parent.mkdir()
    book.write_text(json.dumps({"files": {}}))
    manifest.write_result(tmp_path / "elsewhere.json", {"x": 1}, manifest=book)
    assert manifest.load(book)["files"] == {}
