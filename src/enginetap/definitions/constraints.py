"""Checking a family's constraints on the const axes an instance binds.

A template's ``constraints`` are small integer expressions over its axes
(``num_experts % n_group == 0``). Those naming only const axes can be checked when the
family is instantiated, so ``definitions show/synth --set`` refuses an impossible instance
up front instead of failing inside a generator or a reference. The evaluator accepts only
integer arithmetic without powers, comparisons and boolean operators on names and integer
literals: enginetap's own constraint strings, never arbitrary code.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from enginetap.core.pysource import parse

__all__ = ["broken_constraints"]

_BINARY: dict[type, Callable[[int, int], int]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}
_COMPARE: dict[type, Callable[[int, int], bool]] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge,
}


class _Unsupported(Exception):
    """The expression uses something outside the small language above."""


def broken_constraints(constraints: Iterable[str], consts: Mapping[str, int]) -> list[str]:
    """The constraints that name only keys of ``consts`` and are false for them.

    Constraints that name var axes (or use anything outside the small language) are not
    checked here: they hold per workload, not per instance.
    """
    broken = []
    for rule in constraints:
        try:
            ok = _eval(parse(rule, mode="eval").body, consts)
        except (_Unsupported, SyntaxError, ZeroDivisionError):
            continue
        if not ok:
            broken.append(rule)
    return broken


def _eval(node: ast.AST, names: Mapping[str, int]) -> Any:
    if isinstance(node, ast.Name):
        if node.id not in names:
            raise _Unsupported(node.id)
        return names[node.id]
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_eval(node.left, names), _eval(node.right, names))
    if isinstance(node, ast.Compare):
        left, ok = _eval(node.left, names), True
        for op, right_node in zip(node.ops, node.comparators):
            if type(op) not in _COMPARE:
                raise _Unsupported(type(op).__name__)
            right = _eval(right_node, names)
            ok, left = ok and _COMPARE[type(op)](left, right), right
        return ok
    if isinstance(node, ast.BoolOp):
        values = [_eval(v, names) for v in node.values]
        return all(values) if isinstance(node.op, ast.And) else any(values)
    raise _Unsupported(type(node).__name__)
