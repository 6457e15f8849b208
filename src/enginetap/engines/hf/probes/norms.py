"""RMSNorm probe of the built-in engine: every ``*RMSNorm.forward`` of the model."""

from __future__ import annotations

from typing import Any

from enginetap.capture.probe import Extracted, Probe, ProbeCall
from enginetap.dataset.schema import Definition
from enginetap.engines.hf.probes.common import DTYPES, PAD_NOTE, instantiate, token_rows

__all__ = ["NORM_PROBES"]


# ----------------------------------------------------------------------------- RMSNorm
def _norm_is_offset(module: Any) -> bool:
    """Qwen3-Next's norms scale by (1 + weight) (zero-initialised weight)."""
    return type(module).__name__.startswith("Qwen3Next")


def _define_rmsnorm(call: ProbeCall) -> Definition | None:
    x = call.args.get("hidden_states", call.args.get("x"))
    dtype = DTYPES.get(getattr(x, "dtype", None))
    weight = getattr(call.instance, "weight", None)
    if dtype is None or weight is None or weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        return None
    # Llama-style norms round the normalised row, then the product (``twice``); Qwen3-Next
    # multiplies in float32 and rounds once.
    rounding = "once" if _norm_is_offset(call.instance) else "twice"
    return instantiate("rmsnorm", hidden_size=int(weight.shape[0]), dtype=dtype,
                       rounding=rounding)


def _adapt_rmsnorm(call: ProbeCall) -> Extracted:
    module = call.instance
    x = call.args.get("hidden_states", call.args.get("x"))
    width = x.shape[-1]
    rows = token_rows(call, x).reshape(-1, width)
    output = token_rows(call, call.result).reshape(-1, width)
    weight = module.weight.detach()
    notes = [PAD_NOTE]
    if x.shape[-2] != call.step.padded_tokens and x.dim() > 3:
        notes.append(f"per-head norm: {x.shape[-2]} heads per token flattened into rows")
    if _norm_is_offset(module):
        weight = (1.0 + weight.float()).to(weight.dtype)
        notes.append("engine scales by (1 + weight) in float32: stored weight = 1 + weight, "
                     f"rounded to {weight.dtype} (within the definition's stated spread)")
    eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))
    return Extracted({"hidden_states": rows, "weight": weight, "eps": eps},
                     {"output": output}, notes)


NORM_PROBES: list[Probe] = [
    Probe("hf.rmsnorm", "rmsnorm", _define_rmsnorm, _adapt_rmsnorm, suffix="RMSNorm",
          description="every *RMSNorm.forward(hidden_states) of the model"),
]
