"""Tap: per-step fingerprints of tapped token rows at every sublayer, and their analysis.

Recording (armed in an engine process as the ``tap`` capability): :mod:`.record`,
:mod:`.points`, :mod:`.fingerprint`. Analysis of recorded runs: :mod:`.files` (loading),
:mod:`.pairs`, :mod:`.continuity`, :mod:`.diff`, :mod:`.report`.
"""

from __future__ import annotations

from enginetap.tap.options import TapOptions

__all__ = ["TapOptions"]
