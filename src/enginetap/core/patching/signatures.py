"""Binding a call's arguments by parameter name, fast: wrappers address arguments by name,
and capture binds every call it selects."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["bind_arguments", "call_signature"]

_SIGNATURES: dict[tuple[Any, bool], inspect.Signature] = {}


def call_signature(function: Callable[..., Any]) -> inspect.Signature:
    """The signature of ``function`` as called, computed once per underlying function.

    A bound method (what wrapt passes as ``wrapped`` for instance methods) is keyed by its
    ``__func__`` so that the cache hits across instances; its first parameter is dropped.
    """
    func = getattr(function, "__func__", None)
    bound = func is not None
    key = (func if bound else function, bound)
    sig = _SIGNATURES.get(key)
    if sig is None:
        sig = inspect.signature(key[0])
        if bound:
            sig = sig.replace(parameters=list(sig.parameters.values())[1:])
        _SIGNATURES[key] = sig
    return sig


def bind_arguments(function: Callable[..., Any], args: tuple, kwargs: dict) -> dict[str, Any]:
    """Arguments of one call by parameter name, in parameter order, defaults applied (what
    ``inspect.Signature.bind`` gives, with its errors, in a few microseconds: capture binds
    every call it selects).

    Raises:
        TypeError: the call does not fit the signature (as ``Signature.bind`` says it).
    """
    plan = _bind_plan(function)
    if plan is not None and len(args) <= plan.positional:
        given = len(args)
        try:
            out = {name: args[i] if i < given else kwargs[name] if name in kwargs
                   else plan.defaults[name] for i, name in enumerate(plan.names)}
        except KeyError:  # a required argument is missing: bind says which
            out = None
        if out is not None and all(name in out and plan.names.index(name) >= given
                                   and name not in plan.positional_only for name in kwargs):
            return out
    bound = call_signature(function).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


@dataclass(frozen=True)
class _BindPlan:
    names: tuple[str, ...]
    defaults: dict[str, Any]
    positional_only: frozenset[str]
    positional: int
    """How many leading parameters a positional argument can fill."""


_PLANS: dict[tuple[Any, bool], _BindPlan | None] = {}


def _bind_plan(function: Callable[..., Any]) -> _BindPlan | None:
    """The fast path's view of ``function``'s signature; None for ``*args``/``**kwargs``
    signatures (bound the slow way)."""
    func = getattr(function, "__func__", None)
    key = (function if func is None else func, func is not None)
    if key in _PLANS:
        return _PLANS[key]
    params = list(call_signature(function).parameters.values())
    plan = None
    if all(p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        plan = _BindPlan(tuple(p.name for p in params),
                         {p.name: p.default for p in params if p.default is not p.empty},
                         frozenset(p.name for p in params if p.kind == p.POSITIONAL_ONLY),
                         sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                             for p in params))
    _PLANS[key] = plan
    return plan
