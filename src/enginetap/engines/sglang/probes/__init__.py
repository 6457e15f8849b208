"""SGLang (0.5.23) capture probes: one table of hook points, each mapped onto a definition.

``PROBES`` is what :meth:`SGLangHooks.capture_probes` hands the capture runtime;
``GROUPS`` pairs each probe group with the SGLang sources it relies on, pinned in the drift
lock shipped beside this package (``engines/sglang/capture.lock``, ``LOCK``).
"""

from __future__ import annotations

from pathlib import Path

from enginetap.capture.drift import ProbeLock
from enginetap.capture.probe import Probe
from enginetap.engines.sglang.probes.attention import ATTENTION_PROBES, ATTENTION_TARGETS
from enginetap.engines.sglang.probes.experts import EXPERT_PROBES, EXPERT_TARGETS
from enginetap.engines.sglang.probes.gdn import GDN_PROBES, GDN_TARGETS
from enginetap.engines.sglang.probes.moe import MOE_PROBES, MOE_TARGETS
from enginetap.engines.sglang.probes.norms import NORM_PROBES, NORM_TARGETS

__all__ = ["GROUPS", "LOCK", "LOCKED_TARGETS", "PROBES"]

PROBES: list[Probe] = [*NORM_PROBES, *ATTENTION_PROBES, *MOE_PROBES, *EXPERT_PROBES,
                       *GDN_PROBES]

LOCKED_TARGETS: tuple[str, ...] = (*NORM_TARGETS, *ATTENTION_TARGETS, *MOE_TARGETS,
                                   *EXPERT_TARGETS, *GDN_TARGETS)

GROUPS: tuple[tuple[list[Probe], tuple[str, ...]], ...] = (
    (NORM_PROBES, NORM_TARGETS), (ATTENTION_PROBES, ATTENTION_TARGETS),
    (MOE_PROBES, MOE_TARGETS), (EXPERT_PROBES, EXPERT_TARGETS), (GDN_PROBES, GDN_TARGETS))
"""Each probe group with the engine sources it relies on: a drift refuses the group."""

LOCK = ProbeLock("SGLang", GROUPS, LOCKED_TARGETS,
                 Path(__file__).resolve().parent.parent / "capture.lock")
"""The capture drift lock shipped with these probes (``LOCK.checked_probes()``), checked
when capture arms. Re-pin after reviewing the probes against a new SGLang::

    enginetap guard pin $(python -m enginetap.engines.sglang.probes) \\
        -o src/enginetap/engines/sglang/capture.lock
"""
