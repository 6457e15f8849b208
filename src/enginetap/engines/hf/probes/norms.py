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
    if _norm_is_offset(call.instance):  # scale by 1 + w in float32, one rounding
        return instantiate("rmsnorm_offset", hidden_size=int(weight.shape[0]), dtype=dtype)
    # Llama-style norms round the normalised row, then the product with the weight
    return instantiate("rmsnorm", hidden_size=int(weight.shape[0]), dtype=dtype,
                       rounding="twice")


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
    eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))
    return Extracted({"hidden_states": rows, "weight": weight, "eps": eps},
                     {"output": output}, notes)


NORM_PROBES: list[Probe] = [
    Probe("hf.rmsnorm", "rmsnorm", _define_rmsnorm, _adapt_rmsnorm, suffix="RMSNorm",
          description="every *RMSNorm.forward(hidden_states) of the model"),
]
