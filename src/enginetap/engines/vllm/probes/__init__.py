"""vLLM CPU (0.32) capture probes: one table of hook points, each mapped onto a definition.

``PROBES`` is what :meth:`VLLMHooks.capture_probes` hands the capture runtime;
``LOCKED_TARGETS`` are the engine sources the probes and their adapters rely on (the probe
targets and the functions whose layout or call order the adapters assume), pinned in the
drift lock shipped beside this package (``LOCK``).
"""

from __future__ import annotations

from pathlib import Path

from enginetap.capture.drift import ProbeLock
from enginetap.capture.probe import Probe
from enginetap.engines.vllm.probes.attention import ATTENTION_PROBES, ATTENTION_TARGETS
from enginetap.engines.vllm.probes.gdn import GDN_PROBES, GDN_TARGETS
from enginetap.engines.vllm.probes.mla import (
    MLA_PREFILL_PROBES,
    MLA_PREFILL_TARGETS,
    MLA_PROBES,
    MLA_TARGETS,
)
from enginetap.engines.vllm.probes.moe import MOE_PROBES, MOE_TARGETS
from enginetap.engines.vllm.probes.norms import (
    GEMMA_NORM_PROBES,
    GEMMA_NORM_TARGETS,
    NORM_PROBES,
    NORM_TARGETS,
)

__all__ = ["GROUPS", "LOCK", "LOCKED_TARGETS", "PROBES"]

PROBES: list[Probe] = [*NORM_PROBES, *GEMMA_NORM_PROBES, *ATTENTION_PROBES, *MOE_PROBES,
                       *GDN_PROBES, *MLA_PROBES, *MLA_PREFILL_PROBES]

LOCKED_TARGETS: tuple[str, ...] = (*NORM_TARGETS, *GEMMA_NORM_TARGETS, *ATTENTION_TARGETS,
                                   *MOE_TARGETS, *GDN_TARGETS, *MLA_TARGETS,
                                   *MLA_PREFILL_TARGETS)

GROUPS: tuple[tuple[list[Probe], tuple[str, ...]], ...] = (
    (NORM_PROBES, NORM_TARGETS), (GEMMA_NORM_PROBES, GEMMA_NORM_TARGETS),
    (ATTENTION_PROBES, ATTENTION_TARGETS),
    (MOE_PROBES, MOE_TARGETS), (GDN_PROBES, GDN_TARGETS), (MLA_PROBES, MLA_TARGETS),
    (MLA_PREFILL_PROBES, MLA_PREFILL_TARGETS))
"""Each probe group with the engine sources it relies on: a drift refuses the group."""

LOCK = ProbeLock("vLLM", GROUPS, LOCKED_TARGETS,
                 Path(__file__).resolve().parent.parent / "capture.lock")
"""The capture drift lock shipped with these probes (``LOCK.checked_probes()``), checked
when capture arms. Re-pin after reviewing the probes against a new vLLM::

    enginetap guard pin $(python -m enginetap.engines.vllm.probes) \\
        -o src/enginetap/engines/vllm/capture.lock
"""
