# Fused residual add + RMSNorm, as vLLM's RMSNorm.forward(x, residual) returns it:
#   s = hidden_states + residual (float32);  residual_out = s rounded to dtype
#   variance = mean(s^2) of the float32 s
#   rounding "twice" (vLLM 0.32 CPU, vllm.ir native): output = round(round(s * rsqrt) * weight)
#   rounding "once" (vLLM's C kernel): output = round(residual_out * rsqrt * weight)
# `hidden_size`, `dtype` and `rounding` come from the generated header above.
import torch


def run(hidden_states, residual, weight, eps):
    if hidden_states.shape != residual.shape or hidden_states.shape[-1] != hidden_size:
        raise ValueError(f"hidden_states {tuple(hidden_states.shape)} and residual "
                         f"{tuple(residual.shape)} must both be [batch_size, {hidden_size}]")
    out_dtype = getattr(torch, dtype)
    summed = hidden_states.to(torch.float32) + residual.to(torch.float32)
    residual_out = summed.to(out_dtype)
    inv_rms = torch.rsqrt(summed.pow(2).mean(dim=-1, keepdim=True) + eps)
    w = weight.to(torch.float32)
    if rounding == "twice":
        output = (summed * inv_rms).to(out_dtype).to(torch.float32) * w
    else:
        output = residual_out.to(torch.float32) * inv_rms * w
    return output.to(out_dtype), residual_out
