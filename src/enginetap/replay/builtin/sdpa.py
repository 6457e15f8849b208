"""PyTorch's ``scaled_dot_product_attention`` as the dense attention families, per request.

Layouts: the definitions pack tokens ``[T, H, D]``; SDPA takes ``[batch, H, L, D]``, so each
request is transposed to heads-first and given a batch of 1, with ``enable_gqa`` for grouped
kv heads (query head ``h`` reads kv head ``h // group``: the definitions' grouping). Paged
caches are gathered into each request's contiguous keys. A prefix-cached prefill (``kv_len >
q_len``) puts its queries at the end of the keys, which SDPA's ``is_causal`` (aligned at the
top left) does not do: the mask is passed explicitly. MLA decode attends keys
``[ckv, kpe]`` and values ``ckv``: every head reads the same latent tokens, so the heads are
the query rows of one head. SDPA returns no log-sum-exp: ``lse`` is computed beside it, in
float32, with ``torch.logsumexp`` over the same scaled logits, and is in the timing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from enginetap.replay.builtin.pages import LOG2, PageList, paged_decode, request_slots

if TYPE_CHECKING:
    import torch

    from enginetap.dataset.schema import Definition

__all__ = ["gqa_paged_decode", "gqa_ragged_prefill", "mla_paged_decode"]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Heads-first ``q [Hq, Lq, D]``, ``k/v [Hkv, Lk, D]`` -> output ``[Lq, Hq, Dv]``, lse."""
    import torch
    import torch.nn.functional as F

    out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                         scale=scale, enable_gqa=True)[0]
    group = q.shape[0] // k.shape[0]
    logits = torch.einsum("hqd,hkd->hqk", q.float(), k.float().repeat_interleave(group, 0))
    logits = logits * scale
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1) / LOG2
    return out.transpose(0, 1), lse.transpose(0, 1)


def gqa_ragged_prefill(definition: Definition) -> Callable[..., Any]:
    """``run(q, k, v, qo_indptr, kv_indptr, sm_scale)`` -> ``(output, lse)``."""

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qo_indptr: torch.Tensor,
            kv_indptr: torch.Tensor, sm_scale: Any) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        output = torch.zeros_like(q)
        lse = torch.full(q.shape[:2], float("-inf"), device=q.device)
        qo, kv = qo_indptr.tolist(), kv_indptr.tolist()
        for b in range(len(qo) - 1):
            q0, q1, k0, k1 = qo[b], qo[b + 1], kv[b], kv[b + 1]
            if q1 == q0:
                continue
            rows = torch.arange(q1 - q0, device=q.device)[:, None] + (k1 - k0) - (q1 - q0)
            mask = torch.arange(k1 - k0, device=q.device)[None, :] <= rows
            out_b, lse_b = _attend(q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1),
                                   v[k0:k1].transpose(0, 1), float(sm_scale), mask)
            output[q0:q1], lse[q0:q1] = out_b, lse_b
        return output, lse

    return run


def gqa_paged_decode(definition: Definition) -> Callable[..., Any]:
    """``run(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale)``."""
    return paged_decode(definition, _paged_decode)


def _paged_decode(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
                  pages: PageList, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    output = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], float("-inf"), device=q.device)
    for b, slots in enumerate(request_slots(*pages)):
        if slots.numel():
            out_b, lse_b = _attend(q[b, :, None], k_flat[slots].transpose(0, 1),
                                   v_flat[slots].transpose(0, 1), scale, None)
            output[b], lse[b] = out_b[0], lse_b[0]
    return output, lse


def mla_paged_decode(definition: Definition) -> Callable[..., Any]:
    """``run(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, kv_last_page_len,
    sm_scale)``: keys ``[ckv, kpe]``, values ``ckv``, the heads as query rows."""
    page_size = definition.const_axes["page_size"]

    def run(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor,
            kpe_cache: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
            kv_last_page_len: torch.Tensor, sm_scale: Any) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        keys = torch.cat([ckv_cache, kpe_cache], dim=-1).flatten(0, 1)
        values = ckv_cache.flatten(0, 1)
        query = torch.cat([q_nope, q_pe], dim=-1)
        output = torch.zeros_like(q_nope)
        lse = torch.full(q_nope.shape[:2], float("-inf"), device=q_nope.device)
        for b, slots in enumerate(request_slots(kv_indptr, kv_indices, kv_last_page_len,
                                                page_size)):
            if slots.numel():
                out_b, lse_b = _attend(query[b][None], keys[slots][None], values[slots][None],
                                       float(sm_scale), None)
                output[b], lse[b] = out_b[:, 0], lse_b[:, 0]
        return output, lse

    return run
