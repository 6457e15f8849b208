"""Parse JSON from untrusted files with bounds: no RecursionError, no giant integers.

``json.loads`` raises ``RecursionError`` on a document nested some thousand levels deep
and ``ValueError`` on an integer of more than 4,300 digits (Python's conversion limit),
and lets a 4,000-digit one through to code that expects a count of bytes or tokens.
:func:`loads_bounded` turns every such case into one :class:`BadJson` whose message says
what is wrong in a few words (never echoing the input), so each reader can report
"bad record at FILE:LINE: why".
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MAX_DEPTH", "MAX_INT_DIGITS", "BadJson", "loads_bounded"]

MAX_DEPTH = 64
"""Deepest nesting of arrays and objects accepted (enginetap's own files use under 10)."""
MAX_INT_DIGITS = 40
"""Longest integer accepted, in digits (a 128-bit hash has 39)."""


class BadJson(ValueError):
    """The text is not JSON, or is nested or sized beyond the bounds; ``str()`` says why."""

    def __init__(self, why: str, line: int | None = None, column: int | None = None,
                 msg: str = "") -> None:
        super().__init__(why)
        self.line, self.column = line, column
        """Where a syntax error is (1-based), when it is one."""
        self.msg = msg or why
        """The syntax error alone (json's words), or ``why``."""


def _parse_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise BadJson(f"an integer of {digits} digits (at most {MAX_INT_DIGITS} are accepted)")
    return int(text)


def _depth_at_most(value: Any, limit: int) -> bool:
    """Whether ``value`` nests at most ``limit`` levels (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        elif not isinstance(item, list):
            continue
        if depth > limit:
            return False
        stack.extend((child, depth + 1) for child in item if isinstance(child, (dict, list)))
    return True


def loads_bounded(text: str | bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads(text)``, refusing deep nesting and integers over :data:`MAX_INT_DIGITS`.

    Raises:
        BadJson: not valid JSON (with its line and column), nested more than ``max_depth``
            levels, or holding a too-long integer or a number JSON cannot hold.
    """
    try:
        value = json.loads(text, parse_int=_parse_int)
    except BadJson:
        raise
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}" if exc.lineno > 1 else f"column {exc.colno}"
        raise BadJson(f"not JSON ({exc.msg} at {where})", exc.lineno, exc.colno,
                      exc.msg) from None
    except RecursionError:
        raise BadJson(f"nested too deeply (more than {max_depth} levels)") from None
    except (ValueError, OverflowError) as exc:  # e.g. a float literal beyond the range
        raise BadJson(f"not JSON ({type(exc).__name__})") from None
    if not _depth_at_most(value, max_depth):
        raise BadJson(f"nested too deeply (more than {max_depth} levels)")
    return value
