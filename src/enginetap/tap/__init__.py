"""Tap: per-step fingerprints of tapped token rows at every sublayer, and their analysis.

Recording (armed in an engine process as the ``tap`` capability): :mod:`.record`,
:mod:`.points`, :mod:`.fingerprint`. Analysis of recorded runs, offline and without torch:
:mod:`.analysis`. Between them, :mod:`.schema` (the tap file's header and step record) and
:mod:`.compare` (which checkpoints same-prefix rows must agree on).
"""

from __future__ import annotations

from enginetap.tap.options import TapOptions

__all__ = ["TapOptions"]
