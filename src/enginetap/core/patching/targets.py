"""Naming what to patch: a parsed ``"module:Qualname.attr"`` target and the one resolver of
such paths (patch targets, guard pins and patches, capture probes, capability install
functions and replay solutions all go through :func:`resolve`).

Attributes are read as stored where it matters (:func:`lookup_raw`, :func:`raw_attribute`):
``getattr`` runs the descriptor protocol, so what it returns is not what a restore must
put back.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from typing import Any

from enginetap.errors import PatchError

__all__ = ["MISSING", "ResolveError", "Target", "attribute_path", "lookup_raw", "owner_of",
           "raw_attribute", "resolve"]


@dataclass(frozen=True)
class Target:
    """A parsed ``"module:Qualname.attr"`` path."""

    module: str
    qualname: str

    @classmethod
    def parse(cls, spec: str) -> Target:
        module, sep, qualname = spec.partition(":")
        if not sep or not module or not qualname or any(not p for p in qualname.split(".")):
            raise PatchError(
                f"bad patch target {spec!r}",
                "a target names a module and an attribute path separated by one colon",
                "write it as 'package.module:Class.method' or 'package.module:function'",
            )
        return cls(module, qualname)

    @property
    def owner_path(self) -> list[str]:
        return self.qualname.split(".")[:-1]

    @property
    def attribute(self) -> str:
        return self.qualname.split(".")[-1]

    def __str__(self) -> str:
        return f"{self.module}:{self.qualname}"


class ResolveError(PatchError):
    """A ``"module:qualname"`` does not resolve. ``kind`` says why: ``missing-module`` (not
    installed), ``import-failed`` (its import raised) or ``missing-attribute``."""

    def __init__(self, spec: str, kind: str, why: str) -> None:
        self.kind = kind
        super().__init__(f"cannot resolve {spec}", why,
                         "check the name against the installed package's version")


MISSING = object()
"""What :func:`lookup_raw` returns for an attribute that is absent."""


def lookup_raw(owner: Any, name: str) -> Any:
    """``owner.name`` as stored (a class's ``__dict__`` along its MRO first, so descriptors
    such as ``property`` or ``classmethod`` come back unbound); ``MISSING`` if absent."""
    for klass in owner.__mro__ if isinstance(owner, type) else (owner,):
        try:
            namespace = vars(klass)
        except TypeError:
            break
        if name in namespace:
            return namespace[name]
    return getattr(owner, name, MISSING)


def resolve(spec: str | Target, *, raw: bool = False) -> Any:
    """The object ``"package.module:Qualname.attr"`` names, importing its module.

    ``raw`` reads each attribute as stored (see :func:`lookup_raw`) instead of through
    ``getattr``. The one resolver of enginetap (see the module docstring).

    Raises:
        PatchError: ``spec`` is malformed. ResolveError: the module is not installed, its
            import raised (the error is named), or an attribute is missing.
    """
    target = spec if isinstance(spec, Target) else Target.parse(spec)
    try:
        found: Any = importlib.import_module(target.module)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        kind = ("missing-module" if target.module == missing
                or target.module.startswith(missing + ".") else "import-failed")
        raise ResolveError(str(target), kind, f"importing {target.module} failed: {exc!r}"
                           ) from None
    except Exception as exc:  # a module that fails to import cannot be resolved
        raise ResolveError(str(target), "import-failed",
                           f"importing {target.module} failed: {exc!r}") from None
    return attribute_path(found, target.qualname, str(target), raw=raw)


def attribute_path(found: Any, qualname: str, spec: str, *, raw: bool = False) -> Any:
    """``found.Qualname.attr``, one attribute at a time (as stored, with ``raw``).

    Raises:
        ResolveError: an attribute is missing (``spec`` names what was being resolved).
    """
    for part in qualname.split("."):
        value = lookup_raw(found, part) if raw else getattr(found, part, MISSING)
        if value is MISSING:
            raise ResolveError(spec, "missing-attribute",
                               f"{part!r} is missing on {getattr(found, '__name__', found)!r}")
        found = value
    return found


def owner_of(target: Target) -> Any:
    """Return the object that holds ``target.attribute`` (a module or a class)."""
    owner: Any = sys.modules[target.module]
    for part in target.owner_path:
        try:
            owner = vars(owner)[part] if part in vars(owner) else getattr(owner, part)
        except (AttributeError, TypeError) as exc:
            raise PatchError(
                f"cannot resolve {target}",
                f"{part!r} is missing on {owner!r}",
                "check the target against the installed engine version",
            ) from exc
    return owner


def raw_attribute(owner: Any, name: str) -> tuple[Any, bool]:
    """The attribute as stored (no descriptor binding) and whether ``owner`` holds it itself."""
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if name in vars(klass):
                return vars(klass)[name], klass is owner
        raise AttributeError(name)
    return vars(owner)[name], True
