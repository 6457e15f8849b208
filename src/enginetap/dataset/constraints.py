"""Evaluate a definition's ``constraints`` over axis values without ``eval``.

A constraint is a Python expression such as ``num_qo_heads % num_kv_heads == 0``. Stored
definitions are untrusted, so expressions are interpreted here over a small grammar:
integer and boolean constants, axis names, arithmetic, comparisons, ``and``/``or``/``not``
and conditional expressions. No calls, attributes, subscripts or builtins exist in it.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["ConstraintError", "evaluate", "violations"]

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
_MAX_EXPONENT = 64  # keeps `2 ** 10 ** 10` from hanging the process


class ConstraintError(ValueError):
    """A constraint uses syntax outside the grammar, or a name that is not an axis."""


def evaluate(expression: str, names: Mapping[str, int]) -> bool:
    """Truth value of ``expression`` with ``names`` bound.

    Raises:
        ConstraintError: the expression is not valid, uses an unknown name or unsupported
            syntax, or its arithmetic fails (division by zero, huge power).
    """
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as exc:
        raise ConstraintError(f"not an expression ({exc.msg})") from None
    return bool(_eval(tree.body, names))


def violations(constraints: list[str], names: Mapping[str, int]) -> list[str]:
    """One message per constraint that is false (or cannot be evaluated) for ``names``."""
    out = []
    for expression in constraints:
        try:
            if not evaluate(expression, names):
                used = sorted(n.id for n in ast.walk(ast.parse(expression, mode="eval"))
                              if isinstance(n, ast.Name))
                bound = ", ".join(f"{n}={names[n]}" for n in dict.fromkeys(used) if n in names)
                out.append(f"constraint {expression!r} is false for {bound}")
        except ConstraintError as exc:
            out.append(f"constraint {expression!r} cannot be evaluated: {exc}")
    return out


def _eval(node: ast.AST, names: Mapping[str, int]) -> Any:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float, bool):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in names:
            raise ConstraintError(f"{node.id!r} is not an axis of this definition")
        return names[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _binary(node, names)
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


def _binary(node: ast.BinOp, names: Mapping[str, int]) -> Any:
    left, right = _eval(node.left, names), _eval(node.right, names)
    if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
        raise ConstraintError(f"exponent {right} is larger than {_MAX_EXPONENT}")
    try:
        return _BINARY[type(node.op)](left, right)
    except ArithmeticError as exc:
        raise ConstraintError(f"{ast.unparse(node)!r}: {exc}") from None


def _compare(node: ast.Compare, names: Mapping[str, int]) -> bool:
    left = _eval(node.left, names)
    for op, comparator in zip(node.ops, node.comparators):
        right = _eval(comparator, names)
        if not _COMPARE[type(op)](left, right):
            return False
        left = right
    return True
