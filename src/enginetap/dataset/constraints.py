"""Evaluate a definition's ``constraints`` over axis values without ``eval``.

A constraint is a Python expression such as ``num_qo_heads % num_kv_heads == 0``. Stored
definitions are untrusted, so expressions are interpreted here over a small grammar:
integer and boolean constants, axis names, arithmetic, comparisons, ``and``/``or``/``not``
and conditional expressions. No calls, attributes, subscripts or builtins exist in it.

Evaluation is bounded, since a definition may come from anyone: an expression is refused
when its text, its number of syntax nodes or its nesting exceed fixed limits (checked
without recursion, before evaluating), and when any value it computes exceeds a fixed
magnitude (a power is refused *before* it is computed if its result would be too large).
So no constraint can hang the process, exhaust its memory or raise RecursionError.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Iterable, Mapping
from functools import lru_cache
from typing import Any

from enginetap.core.pysource import parse as parse_source

__all__ = [
    "MAX_CONSTRAINTS", "MAX_DEPTH", "MAX_EXPRESSION_CHARS", "MAX_NODES", "ConstraintError",
    "broken", "evaluate", "parse", "quote", "violations",
]

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {
    ast.UAdd: operator.pos, ast.USub: operator.neg, ast.Not: operator.not_,
}
_COMPARE: dict[type, Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge,
}
MAX_CONSTRAINTS = 64
"""Constraints one definition may hold."""
MAX_EXPRESSION_CHARS = 1000
MAX_NODES = 200
"""Syntax nodes of one expression."""
MAX_DEPTH = 32
"""Nesting of one expression's syntax tree; keeps evaluation far from the recursion limit."""
_MAX_BITS = 256  # any int value beyond 2**256 is refused: axis arithmetic never needs it
_MAX_FLOAT = 2.0 ** _MAX_BITS


class ConstraintError(ValueError):
    """A constraint uses syntax outside the grammar, or a name that is not an axis."""


def evaluate(expression: str, names: Mapping[str, int]) -> bool:
    """Truth value of ``expression`` with ``names`` bound.

    Raises:
        ConstraintError: the expression is not valid, uses an unknown name or unsupported
            syntax, or its arithmetic fails (division by zero, huge power).
    """
    return bool(_eval(parse(expression).body, names))


@lru_cache(maxsize=1024)
def parse(expression: str) -> ast.Expression:
    """The syntax tree of ``expression``, within the size limits (do not mutate it).

    Raises:
        ConstraintError: not an expression, or longer, larger or deeper than the limits.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ConstraintError(f"it is {len(expression)} characters long, more than the "
                              f"limit of {MAX_EXPRESSION_CHARS}")
    try:
        tree = parse_source(expression, mode="eval")
    except SyntaxError as exc:
        raise ConstraintError(f"not an expression ({exc.msg})") from None
    except (MemoryError, RecursionError):  # CPython's parser gives up on deep nesting so
        raise ConstraintError("it is nested too deeply to parse") from None
    _check_size(tree)
    return tree


def _check_size(tree: ast.Expression) -> None:
    # Iterative walk: a recursive one is what a deep expression must not be able to break.
    stack, nodes = [(tree.body, 1)], 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise ConstraintError(f"it has more than {MAX_NODES} syntax nodes")
        if depth > MAX_DEPTH:
            raise ConstraintError(f"it is nested more than {MAX_DEPTH} levels deep")
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))


def violations(constraints: list[str], names: Mapping[str, int]) -> list[str]:
    """One message per constraint that is false (or cannot be evaluated) for ``names``."""
    out = []
    for expression in constraints:
        try:
            if not evaluate(expression, names):
                bound = ", ".join(f"{n}={_show(names[n])}" for n in sorted(_names(expression))
                                  if n in names)
                out.append(f"constraint {quote(expression)} is false for {bound}")
        except ConstraintError as exc:
            out.append(f"constraint {quote(expression)} cannot be evaluated: {exc}")
    return out


def broken(constraints: Iterable[str], names: Mapping[str, int]) -> list[str]:
    """The constraints that name only keys of ``names`` and are false for them.

    A family's const axes are checked this way when it is instantiated: constraints that
    name other axes (var axes) hold per workload, not per instance, and those that cannot
    be evaluated are left to :func:`violations` on the stored definition.
    """
    out = []
    for expression in constraints:
        try:
            if _names(expression) <= names.keys() and not evaluate(expression, names):
                out.append(expression)
        except ConstraintError:
            continue
    return out


def _names(expression: str) -> set[str]:
    return {n.id for n in ast.walk(parse(expression)) if isinstance(n, ast.Name)}


def quote(expression: str, limit: int = 80) -> str:
    """``repr`` of ``expression``, shortened to about ``limit`` characters for messages."""
    if len(expression) <= limit:
        return repr(expression)
    return f"{expression[:limit - 3]!r}... ({len(expression)} characters)"


def _show(value: Any) -> str:
    # An axis never evaluated (short-circuit) may be any size; str() of a huge int raises.
    if isinstance(value, int) and value.bit_length() > _MAX_BITS:
        return f"<a {value.bit_length()}-bit number>"
    return repr(value)


def _eval(node: ast.AST, names: Mapping[str, int]) -> Any:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float, bool):
        return _bounded(node.value, node)
    if isinstance(node, ast.Name):
        if node.id not in names:
            raise ConstraintError(f"{node.id!r} is not an axis of this definition")
        return _bounded(names[node.id], node)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _bounded(_binary(node, names), node)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand, names))
    if isinstance(node, ast.BoolOp):
        values = (_eval(v, names) for v in node.values)
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
        return _compare(node, names)
    if isinstance(node, ast.IfExp):
        branch = node.body if _eval(node.test, names) else node.orelse
        return _eval(branch, names)
    raise ConstraintError(f"unsupported syntax {ast.unparse(node)!r}")


def _bounded(value: Any, node: ast.AST) -> Any:
    """``value`` if its magnitude is within the limit (bools and ints by bits, floats by size)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value.bit_length() <= _MAX_BITS:
        return value
    if isinstance(value, float) and (math.isnan(value) or abs(value) <= _MAX_FLOAT):
        return value
    if isinstance(value, complex):  # e.g. a negative base to a fractional power
        raise ConstraintError(f"{_text(node)!r} is not a real number")
    raise ConstraintError(f"{_text(node)!r} is larger in magnitude than 2**{_MAX_BITS}")


def _text(node: ast.AST) -> str:
    text = ast.unparse(node)
    return text if len(text) <= 60 else text[:57] + "..."


def _binary(node: ast.BinOp, names: Mapping[str, int]) -> Any:
    left, right = _eval(node.left, names), _eval(node.right, names)
    if isinstance(node.op, ast.Pow):
        _check_power(node, left, right)
    try:
        return _BINARY[type(node.op)](left, right)
    except ArithmeticError as exc:
        raise ConstraintError(f"{_text(node)!r}: {exc}") from None


def _check_power(node: ast.BinOp, base: Any, exponent: Any) -> None:
    """Refuse a power whose result would exceed the magnitude limit, before computing it."""
    if base == 0:
        return  # 0 or 1, or ZeroDivisionError for a negative exponent (reported by the caller)
    if exponent * math.log2(abs(base)) > _MAX_BITS:
        raise ConstraintError(f"{_text(node)!r} is larger in magnitude than 2**{_MAX_BITS}")


def _compare(node: ast.Compare, names: Mapping[str, int]) -> bool:
    left = _eval(node.left, names)
    for op, comparator in zip(node.ops, node.comparators):
        right = _eval(comparator, names)
        if not _COMPARE[type(op)](left, right):
            return False
        left = right
    return True
