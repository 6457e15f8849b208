# Causal grouped-query attention over ragged (packed) q and kv, one request per indptr slot.
# Request b owns queries qo_indptr[b]:qo_indptr[b+1] and keys/values kv_indptr[b]:kv_indptr[b+1].
# Queries sit at the END of their request's kv (a prefix-cached prefill has kv_len > q_len):
# query i may attend key j when j <= i + (kv_len - q_len). Query head h reads kv head
# h // (num_qo_heads // num_kv_heads). lse is log2(sum(exp(sm_scale * q.k))), FlashInfer's base.
# `num_qo_heads`, `num_kv_heads`, `head_dim` and `dtype` come from the generated header above.
import math

import torch


def _attend(q, k, v, sm_scale):
    """q [Lq, Hq, D], k/v [Lk, Hkv, D] -> output [Lq, Hq, D] and base-2 lse [Lq, Hq], in float32."""
    q_len, kv_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.to(torch.float32).repeat_interleave(group, dim=1)
    v = v.to(torch.float32).repeat_interleave(group, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q.to(torch.float32), k) * sm_scale
    rows = torch.arange(q_len, device=q.device)[:, None] + (kv_len - q_len)
    logits = logits.masked_fill(torch.arange(kv_len, device=q.device)[None, :] > rows, -math.inf)
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - lse[..., None])
    if bool(torch.isfinite(v).all()):
        output = torch.einsum("hqk,khd->qhd", probs, v)
    else:
        # A query must not see the values of later keys it does not attend (0 * NaN = NaN):
        # with a non-finite value in the request, each query sums over its own prefix only.
        ends = (rows[:, 0] + 1).tolist()
        output = torch.stack([torch.einsum("hk,khd->hd", probs[:, i, :end], v[:end])
                              for i, end in enumerate(ends)])
    return output, (lse / math.log(2.0)).transpose(0, 1)


def run(q, k, v, qo_indptr, kv_indptr, sm_scale):
    if q.shape[1:] != (num_qo_heads, head_dim) or k.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)}: expected heads "
                         f"{num_qo_heads}/{num_kv_heads} of size {head_dim}")
    output = torch.zeros(q.shape, dtype=getattr(torch, dtype), device=q.device)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device)
    qo, kv = qo_indptr.tolist(), kv_indptr.tolist()
    for b in range(len(qo) - 1):
        q0, q1, k0, k1 = qo[b], qo[b + 1], kv[b], kv[b + 1]
        if q1 == q0:
            continue
        if k1 - k0 < q1 - q0:
            raise ValueError(f"request {b}: kv_len {k1 - k0} < q_len {q1 - q0}")
        out_b, lse_b = _attend(q[q0:q1], k[k0:k1], v[k0:k1], sm_scale)
        output[q0:q1] = out_b.to(output.dtype)
        lse[q0:q1] = lse_b
    return output, lse
