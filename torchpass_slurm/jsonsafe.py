"""JSON that cannot hurt its reader: bounded nesting, bounded integers, finite numbers (no zmq).

Python's ``json`` reads ``NaN``, ``Infinity`` and integers of thousands of
digits, and recurses once per level of nesting (a 30,000-deep array is a
RecursionError). :func:`loads` refuses all three *before* they can do harm:
the nesting is measured on the raw text first (a linear scan that skips
strings), and the parser is told to refuse the constants and big integers.
:func:`check_value` checks an already built value the same way (the event
log uses it on what it is asked to write).
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["JSONRefused", "MAX_INT", "loads", "check_value", "nesting_depth"]

#: Largest magnitude of an integer accepted: a signed 64-bit one.
MAX_INT = 2**63 - 1
#: Most digits an integer literal may have before it is even converted (``int()`` is quadratic).
_MAX_DIGITS = 20


class JSONRefused(ValueError):
    """The text or value is not JSON this package accepts (the message says why)."""


def nesting_depth(text: str) -> int:
    """The deepest nesting of ``[``/``{`` in the JSON ``text`` (brackets inside strings skipped)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def loads(text: str, *, max_depth: int) -> Any:
    """``json.loads`` that refuses (JSONRefused) nesting past ``max_depth``, NaN/Infinity,
    integers beyond :data:`MAX_INT` and floats that overflow to infinity."""
    # Counting brackets is fast (C); only text with more brackets than levels allowed is scanned.
    if text.count("[") + text.count("{") > max_depth and nesting_depth(text) > max_depth:
        raise JSONRefused(f"is nested deeper than {max_depth} levels")
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_int=_int, parse_float=_float)
    except RecursionError:  # unreachable after the scan; kept so that no parse can raise it
        raise JSONRefused(f"is nested deeper than {max_depth} levels") from None
    except JSONRefused:
        raise
    except ValueError as exc:
        raise JSONRefused(f"is not JSON: {exc}") from None


def check_value(value: object, *, max_depth: int, where: str = "value") -> None:
    """Raise JSONRefused unless ``value`` is a JSON scalar (finite float, int within
    :data:`MAX_INT`), or lists and str-keyed dicts of them at most ``max_depth`` deep.
    Walked without recursion."""
    pending: list[tuple[object, int, str]] = [(value, 1, where)]
    while pending:
        item, depth, path = pending.pop()
        if item is None or isinstance(item, (str, bool)):
            continue
        if isinstance(item, int):
            if abs(item) > MAX_INT:
                raise JSONRefused(f"{path} is an integer outside the signed 64-bit range")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise JSONRefused(f"{path} is {item!r}; numbers must be finite")
        elif isinstance(item, (list, tuple, dict)):
            if depth > max_depth:
                raise JSONRefused(f"{path} is nested deeper than {max_depth} levels")
            if isinstance(item, dict):
                bad = next((k for k in item if not isinstance(k, str)), None)
                if bad is not None:
                    raise JSONRefused(f"{path} has the key {bad!r}; keys must be strings")
                pending.extend((v, depth + 1, f"{path}.{k}") for k, v in item.items())
            else:
                pending.extend((v, depth + 1, f"{path}[{i}]") for i, v in enumerate(item))
        else:
            raise JSONRefused(f"{path} is a {type(item).__name__}; expected a JSON value")


def _refuse_constant(name: str) -> Any:
    raise JSONRefused(f"holds {name}: every number (ts, seq and the body's) must be finite")


def _int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > _MAX_DIGITS or abs(value := int(text)) > MAX_INT:
        raise JSONRefused(f"holds an integer of {digits} digits, outside the signed 64-bit range")
    return value


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JSONRefused(f"holds the number {text[:32]}, which overflows to infinity")
    return value
