"""Analysis of recorded tap runs, offline: no torch, nothing of the recording side.

:mod:`.files` loads a run (every line validated through :mod:`enginetap.tap.schema`);
:mod:`.pairs` (same-prefix rows that split), :mod:`.continuity` (state and KV carried
from step to step, row metadata), :mod:`.crossrank` (replicated checkpoints across TP
ranks), :mod:`.diff` (two runs aligned request by request), :mod:`.culprit` and
:mod:`.splitsize` (where and by how much) feed :mod:`.report` (text, JSON, the HTML page).
Which checkpoints two rows must agree on is :mod:`enginetap.tap.compare` (the recorder's
raw-row dumps apply the same rule).
"""

from __future__ import annotations

from enginetap.tap.analysis.files import RankTap, StepRecord, TapError, TapRun, load_run

__all__ = ["RankTap", "StepRecord", "TapError", "TapRun", "load_run"]
