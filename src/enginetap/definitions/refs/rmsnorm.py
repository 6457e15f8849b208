# RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight, per row, the mean in float32.
# `rounding` says where the result is rounded to `dtype`:
#   "twice": the normalised row, then its product with the weight (transformers LlamaRMSNorm,
#            vLLM 0.32 CPU's RMSNorm); "once": only the final product (vLLM's C kernel).
# `hidden_size`, `dtype` and `rounding` come from the generated header above.
import torch


def run(hidden_states, weight, eps):
    if hidden_states.shape[-1] != hidden_size:
        raise ValueError(f"hidden_states: last dim {hidden_states.shape[-1]} != {hidden_size}")
    out_dtype = getattr(torch, dtype)
    x = hidden_states.to(torch.float32)
    row = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    if rounding == "twice":
        row = row.to(out_dtype).to(torch.float32)
    return (row * weight.to(torch.float32)).to(out_dtype)
