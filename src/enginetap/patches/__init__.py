"""Guarded engine patches that change how an engine computes, armed by name.

Each patch is a capability (see :mod:`enginetap.capabilities`): its options are validated
when the arming config is parsed, it pins the engine sources it relies on in a lock
shipped beside it (:mod:`enginetap.guard.lock`) and proves itself per shape against the
stock path (:class:`enginetap.guard.ExactPatch`) before it serves.

- :mod:`~enginetap.patches.sp_prefill` — sequence-parallel prefill for vLLM at TP >= 2.
"""

from __future__ import annotations

__all__: list[str] = []
