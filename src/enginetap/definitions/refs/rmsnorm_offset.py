# Gemma-style RMSNorm: y = x / sqrt(mean(x^2) + eps) * (1 + weight), per row.
# The mean, the scale 1 + weight and the product are float32; one rounding to `dtype`.
# `hidden_size` and `dtype` come from the generated header above.
import torch


def run(hidden_states, weight, eps):
    if hidden_states.shape[-1] != hidden_size:
        raise ValueError(f"hidden_states: last dim {hidden_states.shape[-1]} != {hidden_size}")
    x = hidden_states.to(torch.float32)
    row = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (row * (1.0 + weight.to(torch.float32))).to(getattr(torch, dtype))
