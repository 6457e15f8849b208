"""Capture probes of the built-in transformers engine (a table, plus small adapters).

The built-in engine runs a padded batch (``[batch, columns, ...]``, left-padded); every
adapter keeps only the step's real token rows, picked with ``rows.token_index``, and says
so in its notes. Classes are matched by name suffix in the loaded model, so one entry
covers Llama, Qwen3, Qwen3-Next and DeepSeek alike where their code agrees.
"""

from __future__ import annotations

from typing import Any

import torch

from enginetap.capture.probe import Extracted, Probe, ProbeCall, instantiate
from enginetap.dataset.schema import Definition

__all__ = ["PROBES", "token_rows"]

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def token_rows(call: ProbeCall, tensor: torch.Tensor) -> torch.Tensor:
    """The step's real token rows of ``tensor`` (``[batch, columns, *rest]``, or already
    flat ``[tokens, *rest]``), as ``[rows, *rest]`` in step-row order (padding dropped)."""
    step = call.step
    padded = step.padded_tokens or len(step.rows)
    flat = tensor.reshape(padded, *tensor.shape[2:]) if tensor.dim() >= 2 and \
        tensor.shape[0] * tensor.shape[1] == padded and tensor.shape[0] != padded else tensor
    index = step.device_rows("token_index", flat.device)
    return flat.index_select(0, index)


# ----------------------------------------------------------------------------- RMSNorm
def _norm_is_offset(module: Any) -> bool:
    """Qwen3-Next's norms scale by (1 + weight) (zero-initialised weight)."""
    return type(module).__name__.startswith("Qwen3Next")


def _define_rmsnorm(call: ProbeCall) -> Definition | None:
    x = call.args.get("hidden_states", call.args.get("x"))
    dtype = _DTYPES.get(getattr(x, "dtype", None))
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
    notes = ["padding rows of the engine's left-padded batch dropped; rows in step order"]
    if x.shape[-2] != call.step.padded_tokens and x.dim() > 3:
        notes.append(f"per-head norm: {x.shape[-2]} heads per token flattened into rows")
    if _norm_is_offset(module):
        weight = (1.0 + weight.float()).to(weight.dtype)
        notes.append("engine scales by (1 + weight) in float32: stored weight = 1 + weight, "
                     f"rounded to {weight.dtype} (within the definition's stated spread)")
    eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))
    return Extracted({"hidden_states": rows, "weight": weight, "eps": eps},
                     {"output": output}, notes)


PROBES: list[Probe] = [
    Probe("hf.rmsnorm", "rmsnorm", _define_rmsnorm, _adapt_rmsnorm, suffix="RMSNorm",
          description="every *RMSNorm.forward(hidden_states) of the model"),
]
