# Fused residual add + RMSNorm, as vLLM's RMSNorm.forward(x, residual) returns it:
#   s = hidden_states + residual (in float32)
#   output = s / sqrt(mean(s^2) + eps) * weight;  residual_out = s
# `hidden_size` and `dtype` come from the generated header above.
import torch


def run(hidden_states, residual, weight, eps):
    if hidden_states.shape != residual.shape or hidden_states.shape[-1] != hidden_size:
        raise ValueError(f"hidden_states {tuple(hidden_states.shape)} and residual "
                         f"{tuple(residual.shape)} must both be [batch_size, {hidden_size}]")
    out_dtype = getattr(torch, dtype)
    summed = hidden_states.to(torch.float32) + residual.to(torch.float32)
    # The norm reads the float32 sum, not the rounded residual it hands on.
    inv_rms = torch.rsqrt(summed.pow(2).mean(dim=-1, keepdim=True) + eps)
    output = (summed * inv_rms * weight.to(torch.float32)).to(out_dtype)
    return output, summed.to(out_dtype)
