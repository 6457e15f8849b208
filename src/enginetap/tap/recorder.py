"""Where the recorder lived before :mod:`enginetap.tap.record`: its names, re-exported for
modules that still import them from here (``tap/compiled.py``, the vLLM and SGLang tap
points)."""

from __future__ import annotations

from enginetap.tap.format import FORMAT
from enginetap.tap.record.checkpointer import outputs_of
from enginetap.tap.record.quick import QuickPlan
from enginetap.tap.record.recorder import TapRecorder

__all__ = ["FORMAT", "QuickPlan", "TapRecorder", "outputs_of"]
