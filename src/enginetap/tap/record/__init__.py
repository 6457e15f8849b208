"""The recording side of the tap, in an armed engine process.

:mod:`.recorder` (:class:`TapRecorder`: the step lifecycle; :mod:`.calls`, what kernel-level
points call on it), :mod:`.ledger` (what one step accumulates), :mod:`.checkpointer`
(where each checkpoint's rows go), :mod:`.staging` (gathered rows), :mod:`.deferred`
(tensors hashed in place at step end), :mod:`.quick` (settled steps examined after the
forward), :mod:`.transfer` (step end: hashes to the host, the record).
"""

from __future__ import annotations

from enginetap.tap.record.checkpointer import outputs_of
from enginetap.tap.record.recorder import TapRecorder

__all__ = ["TapRecorder", "outputs_of"]
