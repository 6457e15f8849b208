# Gated delta rule (Qwen3-Next linear attention), decode: one token per sequence.
# Per value head h (q/k head h // (num_v_heads // num_qk_heads)), with q and k L2-normalised
# (eps 1e-6) and q multiplied by `scale`, the state S [head_size(k), head_size(v)] of
# sequence b becomes
#   S' = exp(g) * S + k (beta * (v - k^T exp(g) S))^T,   output = q^T S'.
# `num_qk_heads`, `num_v_heads`, `head_size` and `dtype` come from the generated header above.
import torch


def _l2norm(x):
    return x * torch.rsqrt(x.pow(2).sum(dim=-1, keepdim=True) + 1e-6)


def run(q, k, v, g, beta, state, scale):
    state_shape = (num_v_heads, head_size, head_size)
    if q.shape[1:] != (num_qk_heads, head_size) or state.shape[1:] != state_shape:
        raise ValueError(f"q {tuple(q.shape)} / state {tuple(state.shape)}: expected heads "
                         f"{num_qk_heads}/{num_v_heads} of size {head_size}")
    group = num_v_heads // num_qk_heads
    qf = (_l2norm(q.to(torch.float32)) * scale).repeat_interleave(group, dim=1)
    kf = _l2norm(k.to(torch.float32)).repeat_interleave(group, dim=1)
    decayed = torch.exp(g.to(torch.float32))[..., None, None] * state.to(torch.float32)
    recalled = torch.einsum("bhk,bhkv->bhv", kf, decayed)
    delta = beta.to(torch.float32)[..., None] * (v.to(torch.float32) - recalled)
    new_state = decayed + kf[..., :, None] * delta[..., None, :]
    output = torch.einsum("bhk,bhkv->bhv", qf, new_state)
    return output.to(getattr(torch, dtype)), new_state
