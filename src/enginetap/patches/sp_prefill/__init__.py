"""Sequence-parallel prefill for vLLM (V1 runner, eager) at tensor parallelism >= 2.

On a prefill chunk of at least ``min_rows`` rows divisible by the TP size, the residual
stream between sublayers stays split by rows across the ranks: each sublayer all-gathers
its normed input rows, its row-parallel output projection reduce-scatters along rows
instead of all-reducing, and norms and residual adds run on this rank's rows only. The
rows are gathered again after the last layer. Decode, small or indivisible chunks, graph
capture and torch.compile never enter it.

Armed by name: ``ENGINETAP_CAPABILITIES=sp_prefill`` (options under ``options.sp_prefill``,
see :class:`SpPrefillOptions`). Guarded: the vLLM sources it relies on are pinned in
``sp_prefill.lock`` (a drifted vLLM is refused, stock serves) and the first chunk of every
shape is proven against the stock path, agreed over the TP group. See docs/sp_prefill.md.
"""

from __future__ import annotations

from pathlib import Path

from enginetap.patches.sp_prefill.options import Mode, SpPrefillOptions

LOCK = Path(__file__).with_name("sp_prefill.lock")

__all__ = ["LOCK", "Mode", "SpPrefillOptions"]
