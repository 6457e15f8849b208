"""Errors raised at enginetap's boundaries (CLI, loaders, configs, patch installation).

Every error says what failed, why, and how to fix it, so that a user never has to read a
traceback from deep inside to know what to do.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class EnginetapError(Exception):
    """Base class: a failure with a what / why / fix message."""

    def __init__(self, what: str, why: str = "", fix: str = "") -> None:
        self.what, self.why, self.fix = what, why, fix
        super().__init__(self._render())

    def _render(self) -> str:
        text = self.what
        if self.why:
            text += f": {self.why}"
        if self.fix:
            text += f". Fix: {self.fix}"
        return text


class ConfigError(EnginetapError):
    """An arming configuration or option is invalid."""


class PatchError(EnginetapError):
    """A patch target cannot be resolved or installed."""


class DatasetError(EnginetapError):
    """A dataset cannot be read or written as asked."""


class DefinitionError(EnginetapError):
    """An operator definition is unknown or its parameters are invalid."""


def describe_validation(exc: Any, limit: int | None = None) -> str:
    """One line for a pydantic ``ValidationError``: ``field.path: message; ...`` (the first
    ``limit`` failures and a count of the rest; malformed JSON said as such). The one
    formatter of validation errors in enginetap."""
    errors = exc.errors(include_url=False)
    if errors and errors[0]["type"] == "json_invalid":
        return f"malformed JSON ({errors[0]['msg']})"
    shown = errors if limit is None else errors[:limit]
    text = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(root)'}: {e['msg']}" for e in shown)
    return text + (f" (+{len(errors) - len(shown)} more)" if len(errors) > len(shown) else "")


class ProblemsError(EnginetapError):
    """Several independent problems, all reported at once (one line each)."""

    def __init__(self, what: str, problems: Iterable[str], fix: str = "") -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{what} ({len(self.problems)} problem(s)):\n{lines}", fix=fix)

    def _render(self) -> str:
        return self.what + (f"\nFix: {self.fix}" if self.fix else "")


class TrafficError(EnginetapError):
    """A traffic profile or request trace is invalid, or a driver cannot run it."""
