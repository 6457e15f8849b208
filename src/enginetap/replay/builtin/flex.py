"""PyTorch's ``flex_attention`` as the attention families, one call per workload.

Every family becomes one attention of all query rows over all keys, with a block mask that
says which key each row may read:

- ``gqa_ragged_prefill``: packed q and kv, heads first; row ``i`` of request ``b`` reads the
  kv rows ``kv_start[b] .. kv_start[b] + i_in_b + (kv_len - q_len)`` (causal, queries at the
  end of their keys), ``enable_gqa`` for the head groups.
- paged decode (``gqa_paged_decode``, ``mla_paged_decode``): the whole cache flattened to
  slots is the key sequence; request ``b`` reads the slots of its pages.
- paged MLA prefill (``mla_paged_prefill``): query ``i`` of request ``b``'s ``n`` reads the
  slots of its first ``L - n + i + 1`` tokens.
- quantized MLA decode (``mla_decode_fp8_fp4_sink``): both caches dequantized to float32
  (e4m3 codes times their tile scales; e2m1 nibbles times ``2 ** (E8M0 - 127)``), their
  slots one key sequence (FP8 slots first), each row reading its two index lists.
- sparse (``dsa_sparse_mla``, ``sparse_mla_prefill_sink``, ``sparse_gqa_paged_decode``): a
  row reads the slots its index list names (``-1`` and, with ``topk_lens``, entries past the
  row's length excluded; for the GQA decode, the tokens of its selected blocks before
  ``seq_lens``, per kv head).

MLA attends keys ``[ckv, kpe]`` with values ``ckv``, every head the same tokens: the
``(token, head)`` pairs are the rows of one head. flex returns the natural-log log-sum-exp of
the attended logits (``-inf`` and a zero output for a row that reads nothing), divided by
``ln 2`` for the definitions' base 2. The sink of ``sparse_mla_prefill_sink`` and
``mla_decode_fp8_fp4_sink`` adds ``exp(sink)`` to the denominator only:
``output * 1 / (1 + exp(sink - lse))``.

On CUDA flex_attention is compiled (``torch.compile``, its fused Triton kernel); on the CPU
it runs eagerly (unfused, correct, slow), so CPU timings say nothing about the kernel.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from enginetap.replay.builtin.pages import LOG2, PageList, paged_decode, slot_mask, sparse_mask

if TYPE_CHECKING:
    import torch

    from enginetap.dataset.schema import Definition

__all__ = ["dsa_sparse_mla", "gqa_paged_decode", "gqa_ragged_prefill",
           "mla_decode_fp8_fp4_sink", "mla_paged_decode", "mla_paged_prefill",
           "sparse_gqa_paged_decode", "sparse_mla_prefill_sink"]


@functools.cache
def _flex(device_type: str) -> Callable[..., Any]:
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention) if device_type == "cuda" else flex_attention


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
            scale: float, heads: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Heads-first ``q [Hq, Lq, D]``, ``k/v [Hkv, Lk, D]``; ``allowed [Lq, Lk]`` (or
    ``[Hkv, Lq, Lk]`` with ``heads``) -> output ``[Lq, Hq, Dv]`` and base-2 lse ``[Lq, Hq]``."""
    from torch.nn.attention.flex_attention import create_block_mask

    group = q.shape[0] // k.shape[0]

    def mask_mod(b: Any, h: Any, row: Any, col: Any) -> Any:
        return allowed[h // group, row, col] if heads else allowed[row, col]

    block_mask = create_block_mask(mask_mod, None, q.shape[0] if heads else None,
                                   q.shape[1], k.shape[1], device=q.device.type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the eager (CPU) path warns that it is unfused
        out, lse = _flex(q.device.type)(q[None], k[None], v[None], block_mask=block_mask,
                                        scale=scale, enable_gqa=group > 1, return_lse=True)
    return out[0].transpose(0, 1), (lse[0] / LOG2).transpose(0, 1)


def gqa_ragged_prefill(definition: Definition) -> Callable[..., Any]:
    """``run(q, k, v, qo_indptr, kv_indptr, sm_scale)`` -> ``(output, lse)``."""

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qo_indptr: torch.Tensor,
            kv_indptr: torch.Tensor, sm_scale: Any) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        q_len, kv_len = qo_indptr.diff().long(), kv_indptr.diff().long()
        request = torch.repeat_interleave(torch.arange(q_len.numel(), device=q.device), q_len)
        row = torch.arange(q.shape[0], device=q.device) - qo_indptr.long()[request]
        first = kv_indptr.long()[request]
        last = first + row + (kv_len - q_len)[request]
        col = torch.arange(k.shape[0], device=q.device)
        allowed = (col[None, :] >= first[:, None]) & (col[None, :] <= last[:, None])
        return _attend(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), allowed,
                       float(sm_scale))

    return run


def gqa_paged_decode(definition: Definition) -> Callable[..., Any]:
    """``run(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale)``."""
    return paged_decode(definition, _paged_decode)


def _paged_decode(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
                  pages: PageList, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    allowed = slot_mask(*pages, k_flat.shape[0])
    return _attend(q.transpose(0, 1), k_flat.transpose(0, 1), v_flat.transpose(0, 1),
                   allowed, scale)


def _latent(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor,
            kpe_cache: torch.Tensor, allowed: torch.Tensor,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA over latent slots: ``allowed [tokens, slots]`` -> output ``[T, H, ckv]``, lse."""
    import torch

    tokens, heads = q_nope.shape[:2]
    query = torch.cat([q_nope, q_pe], dim=-1).flatten(0, 1)[None]  # rows: (token, head)
    keys = torch.cat([ckv_cache, kpe_cache], dim=-1).flatten(0, 1)[None]
    values = ckv_cache.flatten(0, 1)[None]
    out, lse = _attend(query, keys, values, allowed.repeat_interleave(heads, dim=0), scale)
    return out.reshape(tokens, heads, -1), lse.reshape(tokens, heads)


def mla_paged_decode(definition: Definition) -> Callable[..., Any]:
    """``run(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, kv_last_page_len,
    sm_scale)``."""
    page_size = definition.const_axes["page_size"]

    def run(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor,
            kpe_cache: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
            kv_last_page_len: torch.Tensor, sm_scale: Any) -> tuple[torch.Tensor, torch.Tensor]:
        slots = ckv_cache.shape[0] * ckv_cache.shape[1]
        allowed = slot_mask(kv_indptr, kv_indices, kv_last_page_len, page_size, slots)
        return _latent(q_nope, q_pe, ckv_cache, kpe_cache, allowed, float(sm_scale))

    return run


def dsa_sparse_mla(definition: Definition) -> Callable[..., Any]:
    """``run(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale)``."""

    def run(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor,
            kpe_cache: torch.Tensor, sparse_indices: torch.Tensor,
            sm_scale: Any) -> tuple[torch.Tensor, torch.Tensor]:
        slots = ckv_cache.shape[0] * ckv_cache.shape[1]
        allowed = sparse_mask(sparse_indices, sparse_indices >= 0, slots)
        return _latent(q_nope, q_pe, ckv_cache, kpe_cache, allowed, float(sm_scale))

    return run


def sparse_mla_prefill_sink(definition: Definition) -> Callable[..., Any]:
    """``run(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, topk_lens, attn_sink,
    sm_scale)``: the sink rescales flex's output by its share of the denominator."""

    def run(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor,
            kpe_cache: torch.Tensor, sparse_indices: torch.Tensor, topk_lens: torch.Tensor,
            attn_sink: torch.Tensor, sm_scale: Any) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        positions = torch.arange(sparse_indices.shape[1], device=sparse_indices.device)
        valid = (positions[None, :] < topk_lens[:, None]) & (sparse_indices >= 0)
        slots = ckv_cache.shape[0] * ckv_cache.shape[1]
        out, lse = _latent(q_nope, q_pe, ckv_cache, kpe_cache,
                           sparse_mask(sparse_indices, valid, slots), float(sm_scale))
        share = torch.sigmoid(lse * LOG2 - attn_sink.float()[None, :])  # 1 / (1 + e^(s - lse))
        return (out.float() * share[..., None]).to(out.dtype), lse

    return run


def sparse_gqa_paged_decode(definition: Definition) -> Callable[..., Any]:
    """``run(q, k_cache, v_cache, page_table, seq_lens, block_ids, sm_scale)``."""
    consts = definition.const_axes
    page_size, block_size = consts["page_size"], consts["block_size"]

    def run(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            page_table: torch.Tensor, seq_lens: torch.Tensor, block_ids: torch.Tensor,
            sm_scale: Any) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        heads = k_cache.shape[2]
        ids = block_ids.expand(-1, heads, -1).long()  # [B, kv heads, topk]
        tokens = (ids[..., None] * block_size + torch.arange(block_size, device=q.device))
        tokens = tokens.flatten(-2)  # [B, kv, topk * block_size]
        valid = (ids[..., None] >= 0).expand(*ids.shape, block_size).flatten(-2)
        valid &= tokens < seq_lens.long()[:, None, None]
        page = torch.where(valid, tokens // page_size, torch.zeros_like(tokens))
        rows = torch.arange(q.shape[0], device=q.device)[:, None, None]
        slot = page_table.long()[rows, page] * page_size + tokens % page_size
        k_flat, v_flat = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
        allowed = sparse_mask(slot, valid, k_flat.shape[0]).transpose(0, 1)  # [kv, B, slots]
        return _attend(q.transpose(0, 1), k_flat.transpose(0, 1), v_flat.transpose(0, 1),
                       allowed, float(sm_scale), heads=True)

    return run


def mla_paged_prefill(definition: Definition) -> Callable[..., Any]:
    """``run(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices,
    kv_last_page_len, sm_scale)``."""
    page_size = definition.const_axes["page_size"]

    def run(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor,
            kpe_cache: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
            kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor,
            sm_scale: Any) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        from enginetap.replay.builtin.pages import request_slots

        slots = ckv_cache.shape[0] * ckv_cache.shape[1]
        allowed = torch.zeros(q_nope.shape[0], slots, dtype=torch.bool, device=q_nope.device)
        qo = qo_indptr.tolist()
        for b, own in enumerate(request_slots(kv_indptr, kv_indices, kv_last_page_len,
                                              page_size)):
            n, length = qo[b + 1] - qo[b], own.numel()
            # causal: the i-th of n new tokens sees its first length - n + i + 1 tokens
            last = torch.arange(n, device=own.device) + (length - n)
            allowed[qo[b]:qo[b + 1], own] = (torch.arange(length, device=own.device)[None, :]
                                             <= last[:, None])
        return _latent(q_nope, q_pe, ckv_cache, kpe_cache, allowed, float(sm_scale))

    return run


_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _dequant_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e2m1 codes, two per byte (low nibble first), times ``2 ** (E8M0 - 127)`` per 32."""
    import torch

    table = torch.tensor(_E2M1, dtype=torch.float32, device=packed.device)
    byte = packed.to(torch.int32) & 0xFF
    values = torch.stack((table[byte & 0xF], table[byte >> 4]), dim=-1).flatten(-2)
    exponent = (scale.to(torch.int32) & 0xFF).to(torch.float32)
    factor = torch.where(exponent == 255, torch.full_like(exponent, float("nan")),
                         torch.exp2(exponent - 127.0))
    return values * factor.repeat_interleave(32, dim=-1)


def mla_decode_fp8_fp4_sink(definition: Definition) -> Callable[..., Any]:
    """``run(q_nope, q_pe, ckv8_cache, ckv8_scale, kpe8_cache, ckv4_cache, ckv4_scale,
    kpe4_cache, indices8, indices4, attn_sink, sm_scale)``; float32 throughout, bf16 out."""
    consts = definition.const_axes
    tile = consts["ckv_dim"] // consts["ckv_tiles"]

    def run(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv8_cache: torch.Tensor,
            ckv8_scale: torch.Tensor, kpe8_cache: torch.Tensor, ckv4_cache: torch.Tensor,
            ckv4_scale: torch.Tensor, kpe4_cache: torch.Tensor, indices8: torch.Tensor,
            indices4: torch.Tensor, attn_sink: torch.Tensor,
            sm_scale: Any) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        latent8 = ckv8_cache.float() * ckv8_scale.float().repeat_interleave(tile, dim=-1)
        latent4 = _dequant_fp4(ckv4_cache, ckv4_scale)
        ckv = torch.cat([latent8.flatten(0, 1), latent4.flatten(0, 1)])[:, None]
        kpe = torch.cat([kpe8_cache.flatten(0, 1), kpe4_cache.flatten(0, 1)]).float()[:, None]
        first4 = latent8.shape[0] * latent8.shape[1]  # FP4 slots follow the FP8 ones
        index = torch.cat([indices8.long(), torch.where(indices4 >= 0, indices4.long() + first4,
                                                        -1)], dim=1)
        allowed = sparse_mask(index, index >= 0, ckv.shape[0])
        out, lse = _latent(q_nope.float(), q_pe.float(), ckv, kpe, allowed, float(sm_scale))
        share = torch.sigmoid(lse * LOG2 - attn_sink.float()[None, :])
        return (out * share[..., None]).to(torch.bfloat16), lse

    return run
