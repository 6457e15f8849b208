# Residual add then Gemma-style RMSNorm (scale by 1 + weight), everything in float32:
#   s = hidden_states + residual (float32);  residual_out = s rounded to dtype
#   output = round(s * rsqrt(mean(s^2) + eps) * (1 + weight)), one rounding at the end
# `hidden_size` and `dtype` come from the generated header above.
import torch


def run(hidden_states, residual, weight, eps):
    if hidden_states.shape != residual.shape or hidden_states.shape[-1] != hidden_size:
        raise ValueError(f"hidden_states {tuple(hidden_states.shape)} and residual "
                         f"{tuple(residual.shape)} must both be [batch_size, {hidden_size}]")
    out_dtype = getattr(torch, dtype)
    summed = hidden_states.to(torch.float32) + residual.to(torch.float32)
    inv_rms = torch.rsqrt(summed.pow(2).mean(dim=-1, keepdim=True) + eps)
    output = summed * inv_rms * (1.0 + weight.to(torch.float32))
    return output.to(out_dtype), summed.to(out_dtype)
