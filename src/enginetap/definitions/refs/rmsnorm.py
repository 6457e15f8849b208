# RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight, per row.
# `hidden_size` and `dtype` come from the generated header above.
import torch


def run(hidden_states, weight, eps):
    if hidden_states.shape[-1] != hidden_size:
        raise ValueError(f"hidden_states: last dim {hidden_states.shape[-1]} != {hidden_size}")
    # One rounding only: reduce, scale and weight in float32, then cast to the activation dtype.
    x = hidden_states.to(torch.float32)
    inv_rms = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (x * inv_rms * weight.to(torch.float32)).to(getattr(torch, dtype))
