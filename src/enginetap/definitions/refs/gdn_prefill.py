# Gated delta rule (Qwen3-Next linear attention), prefill over packed variable-length sequences.
# Per value head h (q/k head h // (num_v_heads // num_qk_heads)), with q and k L2-normalised
# (eps 1e-6) and q multiplied by `scale`, the state S [head_size(k), head_size(v)] follows
#   S = exp(g_t) * S;  S = S + k_t (beta_t * (v_t - k_t^T S))^T;  o_t = q_t^T S.
# Sequence s spans cu_seqlens[s]:cu_seqlens[s+1] and starts from initial_state[s].
# The reference runs the equivalent chunked form (64 tokens a chunk, in float32): inside a
# chunk with cumulative log-decay G_i, the per-token updates u solve the unit lower-triangular
# system (I + diag(beta) A) u = beta v - beta exp(G) k S0, A_ij = exp(G_i - G_j) k_i.k_j (j < i).
# `num_qk_heads`, `num_v_heads`, `head_size` and `dtype` come from the generated header above.
import torch

CHUNK_SIZE = 64


def _l2norm(x):
    return x * torch.rsqrt(x.pow(2).sum(dim=-1, keepdim=True) + 1e-6)


def _chunk(q, k, v, g, beta, state):
    """One chunk, all heads: q/k [H, L, K], v [H, L, V], g/beta [H, L], state [H, K, V]."""
    length = q.shape[1]
    cum = g.cumsum(dim=-1)
    lower = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(G_i - G_j) for j <= i; masked before exp so nothing overflows.
    decay = torch.exp((cum[:, :, None] - cum[:, None, :]).masked_fill(~lower, float("-inf")))
    system = beta[..., None] * (decay * (k @ k.transpose(-1, -2))).tril(-1)
    system = system + torch.eye(length, dtype=q.dtype, device=q.device)
    rhs = torch.cat([beta[..., None] * v, (beta * cum.exp())[..., None] * k], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u = solved[..., : v.shape[-1]] - solved[..., v.shape[-1]:] @ state
    out = (cum.exp()[..., None] * q) @ state + (decay * (q @ k.transpose(-1, -2))) @ u
    tail = torch.exp(cum[:, -1:] - cum)[..., None] * k
    new_state = cum[:, -1].exp()[:, None, None] * state + tail.transpose(-1, -2) @ u
    return out, new_state


def run(q, k, v, g, beta, initial_state, cu_seqlens, scale):
    if q.shape[1:] != (num_qk_heads, head_size) or v.shape[1:] != (num_v_heads, head_size):
        raise ValueError(f"q {tuple(q.shape)} / v {tuple(v.shape)}: expected heads "
                         f"{num_qk_heads}/{num_v_heads} of size {head_size}")
    group = num_v_heads // num_qk_heads
    # Heads first: [H, T, D] and [H, T].
    qf = (_l2norm(q.to(torch.float32)) * scale).repeat_interleave(group, dim=1).transpose(0, 1)
    kf = _l2norm(k.to(torch.float32)).repeat_interleave(group, dim=1).transpose(0, 1)
    vf = v.to(torch.float32).transpose(0, 1)
    gf, bf = g.to(torch.float32).transpose(0, 1), beta.to(torch.float32).transpose(0, 1)
    out = torch.empty_like(vf)
    final_state = torch.empty(initial_state.shape, dtype=torch.float32, device=q.device)
    bounds = cu_seqlens.tolist()
    for s in range(len(bounds) - 1):
        state = initial_state[s].to(torch.float32)
        for c0 in range(bounds[s], bounds[s + 1], CHUNK_SIZE):
            c1 = min(c0 + CHUNK_SIZE, bounds[s + 1])
            out[:, c0:c1], state = _chunk(qf[:, c0:c1], kf[:, c0:c1], vf[:, c0:c1],
                                          gf[:, c0:c1], bf[:, c0:c1], state)
        final_state[s] = state
    return out.transpose(0, 1).to(getattr(torch, dtype)), final_state
