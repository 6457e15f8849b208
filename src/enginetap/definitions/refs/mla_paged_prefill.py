# DeepSeek multi-head latent attention, absorbed prefill over a paged latent cache (causal).
# Every head attends the same latent tokens: key = [ckv, kpe], value = ckv, so
#   logits = sm_scale * (q_nope . ckv + q_pe . kpe),  output = softmax(logits) @ ckv.
# Request b owns query rows qo_indptr[b]:qo_indptr[b+1] and pages
# kv_indices[kv_indptr[b]:kv_indptr[b+1]] (all full except the last, holding
# kv_last_page_len[b] tokens). Its n queries are its last n tokens: query i attends keys
# 0 .. L - n + i of its L tokens (cached prefix first). lse is base 2.
# `num_qo_heads`, `head_dim_ckv`, `head_dim_kpe`, `page_size`, `dtype` come from the header above.
import math

import torch


def _gather(cache, pages, length):
    """The first `length` tokens stored in `pages` of `cache`, as float32 [length, dim]."""
    return cache[pages].reshape(-1, cache.shape[-1])[:length].to(torch.float32)


def run(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
        sm_scale):
    shapes = [q_nope.shape[1:], q_pe.shape[1:], ckv_cache.shape[1:], kpe_cache.shape[1:]]
    expected = [(num_qo_heads, head_dim_ckv), (num_qo_heads, head_dim_kpe),
                (page_size, head_dim_ckv), (page_size, head_dim_kpe)]
    if shapes != expected:
        raise ValueError("q_nope/q_pe/ckv_cache/kpe_cache shapes do not match "
                         f"h{num_qo_heads} ckv{head_dim_ckv} kpe{head_dim_kpe} ps{page_size}")
    output = torch.zeros(q_nope.shape, dtype=getattr(torch, dtype), device=q_nope.device)
    lse = torch.full(q_nope.shape[:2], -math.inf, dtype=torch.float32, device=q_nope.device)
    qo, kv, last = qo_indptr.tolist(), kv_indptr.tolist(), kv_last_page_len.tolist()
    for b in range(len(qo) - 1):
        n = qo[b + 1] - qo[b]
        pages = kv_indices[kv[b]:kv[b + 1]].to(torch.long)
        if n == 0:
            continue
        if pages.numel() == 0 or not 1 <= last[b] <= page_size:
            raise ValueError(f"request {b}: {n} queries need pages with 1..{page_size} tokens "
                             f"in the last (kv_last_page_len {last[b]})")
        length = (pages.numel() - 1) * page_size + last[b]
        if length < n:
            raise ValueError(f"request {b}: {n} queries but only {length} tokens")
        ckv, kpe = _gather(ckv_cache, pages, length), _gather(kpe_cache, pages, length)
        rows = slice(qo[b], qo[b + 1])
        q_ckv, q_kpe = q_nope[rows].to(torch.float32), q_pe[rows].to(torch.float32)
        logits = (q_ckv @ ckv.T + q_kpe @ kpe.T) * sm_scale  # [n, heads, length]
        keys = torch.arange(length, device=q_nope.device)
        limit = torch.arange(n, device=q_nope.device) + (length - n)
        logits = logits.masked_fill((keys[None, :] > limit[:, None])[:, None, :], -math.inf)
        lse_b = torch.logsumexp(logits, dim=-1)
        probs = torch.exp(logits - lse_b[..., None])
        # A query's output depends only on the tokens it attends: a non-finite latent a
        # query does not reach (a later token) must not enter its sum as 0 * NaN.
        bad = ~torch.isfinite(ckv).all(dim=-1)
        if bool(bad.any()):
            out = probs @ ckv.masked_fill(bad[:, None], 0.0)
            for j in bad.nonzero().flatten().tolist():
                readers = limit >= j
                out[readers] += probs[readers][:, :, j, None] * ckv[j]
        else:
            out = probs @ ckv
        output[rows] = out.to(output.dtype)
        lse[rows] = lse_b / math.log(2.0)
    return output, lse
