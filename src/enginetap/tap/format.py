"""The tap file format's name and version, kept importable here for the recorder until
it imports them from :mod:`enginetap.tap.schema` (issue 28: removed at that merge)."""

from __future__ import annotations

from enginetap.tap.schema import FORMAT, VERSION

__all__ = ["FORMAT", "VERSION"]
