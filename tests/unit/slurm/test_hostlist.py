"""Hostlist expand/compress over python-hostlist, and how bad input is reported."""

from __future__ import annotations

import pytest

from torchpass_slurm.errors import HostlistError
from torchpass_slurm.slurm.hostlist import compress, expand


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("n[1-2]", ("n1", "n2")),
        ("n1", ("n1",)),
        ("n[1-3,7],gpu01", ("n1", "n2", "n3", "n7", "gpu01")),
        ("x[08-10]", ("x08", "x09", "x10")),
        ("n[3,1]", ("n3", "n1")),
        ("rack[1-2]-n[1-2]", ("rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2")),
        ("", ()),
        ("  ", ()),
    ],
)
def test_expand(expr: str, names: tuple[str, ...]) -> None:
    assert expand(expr) == names


@pytest.mark.parametrize(
    ("names", "expr"),
    [
        (["n1", "n2"], "n[1-2]"),
        (["n1", "n2", "n3", "n7", "gpu01"], "gpu01,n[1-3,7]"),
        (["x08", "x09", "x10"], "x[08-10]"),
        (["n1", "n1"], "n1"),
        ([], ""),
    ],
)
def test_compress(names: list[str], expr: str) -> None:
    assert compress(names) == expr


@pytest.mark.parametrize("expr", ["n[1-3,7],gpu01", "x[08-10]", "a,b,c[1-2]"])
def test_round_trip(expr: str) -> None:
    assert set(expand(compress(expand(expr)))) == set(expand(expr))


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        ("n[1-", "malformed hostlist 'n[1-': unbalanced brackets"),
        ("n[3-1]", "malformed hostlist 'n[3-1]': start > stop"),
        ("n[a-b]", "malformed hostlist 'n[a-b]': bad range"),
        ("n1 n2", "malformed hostlist 'n1 n2': it contains whitespace"),
    ],
)
def test_expand_malformed(expr: str, message: str) -> None:
    with pytest.raises(HostlistError) as info:
        expand(expr)
    assert info.value.message == message
    assert info.value.exit_code == 2
    assert info.value.hint


@pytest.mark.parametrize("name", ["n[1-2]", "a,b", "a b", ""])
def test_compress_rejects_non_names(name: str) -> None:
    with pytest.raises(HostlistError) as info:
        compress(["n1", name])
    assert info.value.message == f"not a node name: {name!r}"
