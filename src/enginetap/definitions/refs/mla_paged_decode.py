# DeepSeek multi-head latent attention, absorbed decode over a paged latent cache.
# Every head attends the same latent tokens: key = [ckv, kpe], value = ckv, so
#   logits = sm_scale * (q_nope . ckv + q_pe . kpe),  output = softmax(logits) @ ckv.
# Request b owns pages kv_indices[kv_indptr[b]:kv_indptr[b+1]]; all are full except the last,
# which holds kv_last_page_len[b] tokens. lse is base 2 (FlashInfer's convention).
# A request without pages gets output 0 and lse -inf, whatever its kv_last_page_len; a
# request with pages needs 1 <= kv_last_page_len <= page_size.
# `num_qo_heads`, `head_dim_ckv`, `head_dim_kpe`, `page_size`, `dtype` come from the header above.
import math

import torch


def _gather(cache, pages, length):
    """The first `length` tokens stored in `pages` of `cache`, as float32 [length, dim]."""
    return cache[pages].reshape(-1, cache.shape[-1])[:length].to(torch.float32)


def run(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale):
    shapes = [q_nope.shape[1:], q_pe.shape[1:], ckv_cache.shape[1:], kpe_cache.shape[1:]]
    expected = [(num_qo_heads, head_dim_ckv), (num_qo_heads, head_dim_kpe),
                (page_size, head_dim_ckv), (page_size, head_dim_kpe)]
    if shapes != expected:
        raise ValueError("q_nope/q_pe/ckv_cache/kpe_cache shapes do not match "
                         f"h{num_qo_heads} ckv{head_dim_ckv} kpe{head_dim_kpe} ps{page_size}")
    output = torch.zeros(q_nope.shape, dtype=getattr(torch, dtype), device=q_nope.device)
    lse = torch.full(q_nope.shape[:2], -math.inf, dtype=torch.float32, device=q_nope.device)
    indptr, last = kv_indptr.tolist(), kv_last_page_len.tolist()
    for b in range(q_nope.shape[0]):
        pages = kv_indices[indptr[b]:indptr[b + 1]].to(torch.long)
        if pages.numel() == 0:
            continue  # no pages: attends nothing (kv_last_page_len ignored)
        if not 1 <= last[b] <= page_size:
            raise ValueError(f"request {b}: kv_last_page_len {last[b]} is not in 1..{page_size}")
        length = (pages.numel() - 1) * page_size + last[b]
        ckv = _gather(ckv_cache, pages, length)
        kpe = _gather(kpe_cache, pages, length)
        q_ckv, q_kpe = q_nope[b].to(torch.float32), q_pe[b].to(torch.float32)
        logits = (q_ckv @ ckv.T + q_kpe @ kpe.T) * sm_scale
        lse_b = torch.logsumexp(logits, dim=-1)
        output[b] = (torch.exp(logits - lse_b[:, None]) @ ckv).to(output.dtype)
        lse[b] = lse_b / math.log(2.0)
    return output, lse
