"""Worked examples of guarded engine patches (see docs/guard.md)."""

from __future__ import annotations

__all__: list[str] = []
