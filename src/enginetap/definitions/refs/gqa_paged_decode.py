# Grouped-query attention decode over a paged KV cache: one query token per request.
# Request b owns the pages kv_indices[kv_indptr[b]:kv_indptr[b+1]] in order; all are full
# except the last, which holds kv_last_page_len[b] tokens. Cache layout is NHD:
# [num_pages, page_size, num_kv_heads, head_dim]. Query head h reads kv head
# h // (num_qo_heads // num_kv_heads). lse is log2(sum(exp(sm_scale * q.k))), FlashInfer's base.
# A request without pages gets output 0 and lse -inf, whatever its kv_last_page_len; a
# request with pages needs 1 <= kv_last_page_len <= page_size.
# `num_qo_heads`, `num_kv_heads`, `head_dim`, `page_size` and `dtype` come from the header above.
import math

import torch


def _gather(cache, pages, length):
    """The first `length` tokens stored in `pages` of `cache`, as [length, heads, dim]."""
    return cache[pages].reshape(-1, *cache.shape[2:])[:length]


def run(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale):
    pages_shape = (page_size, num_kv_heads, head_dim)
    if q.shape[1:] != (num_qo_heads, head_dim) or k_cache.shape[1:] != pages_shape:
        raise ValueError(f"q {tuple(q.shape)} / k_cache {tuple(k_cache.shape)} do not match "
                         f"h{num_qo_heads} kv{num_kv_heads} d{head_dim} ps{page_size}")
    group = num_qo_heads // num_kv_heads
    output = torch.zeros(q.shape, dtype=getattr(torch, dtype), device=q.device)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device)
    indptr, last = kv_indptr.tolist(), kv_last_page_len.tolist()
    for b in range(q.shape[0]):
        pages = kv_indices[indptr[b]:indptr[b + 1]].to(torch.long)
        if pages.numel() == 0:
            continue  # no pages: attends nothing (kv_last_page_len ignored)
        if not 1 <= last[b] <= page_size:
            raise ValueError(f"request {b}: kv_last_page_len {last[b]} is not in 1..{page_size}")
        length = (pages.numel() - 1) * page_size + last[b]
        k = _gather(k_cache, pages, length).to(torch.float32).repeat_interleave(group, dim=1)
        v = _gather(v_cache, pages, length).to(torch.float32).repeat_interleave(group, dim=1)
        logits = torch.einsum("hd,khd->hk", q[b].to(torch.float32), k) * sm_scale
        lse_b = torch.logsumexp(logits, dim=-1)
        out_b = torch.einsum("hk,khd->hd", torch.exp(logits - lse_b[:, None]), v)
        output[b] = out_b.to(output.dtype)
        lse[b] = lse_b / math.log(2.0)
    return output, lse
