"""MLA absorbed decode over two quantized paged latent caches, with an attention sink.

Each query (one per sequence) attends the union of two token sets:

* FP8 scope: slots ``indices8[b]`` of the FP8 cache. A token's latent is
  ``ckv8_cache[p, s, j] * ckv8_scale[p, s, j // (ckv_dim // ckv_tiles)]`` (e4m3fn codes, one
  float32 scale per token and tile), its rope part ``kpe8_cache[p, s]`` (bf16).
* FP4 scope: slots ``indices4[b]`` of the FP4 cache. A token's latent is the e2m1 codes of
  ``ckv4_cache[p, s]`` (two per byte, element ``2i`` in the low nibble, ``2i + 1`` in the
  high nibble) times ``2 ** (ckv4_scale[p, s, j // 32] - 127)`` (E8M0 bytes read unsigned,
  255 is NaN); its rope part ``kpe4_cache[p, s]`` (bf16).

A slot is ``page * page_size + offset``; ``-1`` marks padding anywhere in a row. Logits are
``sm_scale * (q_nope . latent + q_pe . rope)``; the value of a token is its latent. The sink
adds ``exp(attn_sink[h])`` to the softmax denominator and nothing to the numerator
(``-inf`` disables it). ``lse`` is the base-2 log-sum-exp of the logits of the attended
tokens, sink excluded (``-inf`` when a row attends nothing; its output is then zero).
"""

import math

import torch

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _refuse_duplicates(indices, valid, what):
    # The contract wants distinct slots per row (engines' top-k selections are): a gather
    # kernel would attend a repeated slot twice, a mask kernel once, so neither is right.
    placeholder = -1 - torch.arange(indices.shape[-1], device=indices.device)
    ordered = torch.where(valid, indices.long(), placeholder).sort(dim=-1).values
    if bool((ordered[..., 1:] == ordered[..., :-1]).any()):
        raise ValueError(f"{what}: a row lists the same slot twice; rows must be distinct")


def _fp4_decode(packed):
    table = torch.tensor(E2M1_MAGNITUDES + tuple(-v for v in E2M1_MAGNITUDES),
                         dtype=torch.float32, device=packed.device)
    byte = packed.to(torch.int32) & 0xFF
    return torch.stack((table[byte & 0xF], table[byte >> 4]), dim=-1).flatten(-2)


def _e8m0_decode(raw):
    exponent = (raw.to(torch.int32) & 0xFF).to(torch.float32)
    return torch.where(exponent == 255, torch.full_like(exponent, float("nan")),
                       torch.exp2(exponent - 127.0))


def _slots(indices, num_pages, scope):
    valid = indices >= 0
    _refuse_duplicates(indices, valid, scope)
    if bool((indices >= num_pages * page_size).any()):
        raise ValueError(f"{scope}: a slot index is beyond num_pages * page_size")
    slot = indices.clamp(min=0).long()
    return slot // page_size, slot % page_size, valid


def _gather_fp8(cache, scale, kpe, indices):
    page, offset, valid = _slots(indices, cache.shape[0], "indices8")
    tile = ckv_dim // ckv_tiles
    latent = cache[page, offset].to(torch.float32)
    latent = latent * scale[page, offset].to(torch.float32).repeat_interleave(tile, -1)
    return _attended(latent, kpe[page, offset], valid)


def _gather_fp4(cache, scale, kpe, indices):
    page, offset, valid = _slots(indices, cache.shape[0], "indices4")
    latent = _fp4_decode(cache[page, offset])
    latent = latent * _e8m0_decode(scale[page, offset]).repeat_interleave(32, -1)
    return _attended(latent, kpe[page, offset], valid)


def _attended(latent, rope, valid):
    # Padding reads slot 0 as a placeholder: zero it, so that a NaN code or scale there
    # (0 * NaN = NaN) cannot reach a row that does not attend slot 0.
    keep = valid[..., None]
    return (torch.where(keep, latent, 0.0), torch.where(keep, rope.to(torch.float32), 0.0),
            valid)


def _attend(logits, valid, sink, values):
    """Softmax over ``valid`` keys plus the sink; returns (output, lse in base 2)."""
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    peak = torch.maximum(logits.amax(dim=-1), sink[None, :])
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    weights = torch.exp(logits - peak[..., None])
    denominator = weights.sum(dim=-1) + torch.exp(sink[None, :] - peak)
    numerator = torch.einsum("bht,btd->bhd", weights, values)
    safe = torch.where(denominator > 0, denominator, torch.ones_like(denominator))
    output = numerator / safe[..., None]
    return output, lse / math.log(2.0)


def run(q_nope, q_pe, ckv8_cache, ckv8_scale, kpe8_cache, ckv4_cache, ckv4_scale, kpe4_cache,
        indices8, indices4, attn_sink, sm_scale):
    if ckv_dim % ckv_tiles or ckv_packed * 2 != ckv_dim or ckv_groups * 32 != ckv_dim:
        raise ValueError("axes must satisfy ckv_dim % ckv_tiles == 0, ckv_packed * 2 == ckv_dim, "
                         "ckv_groups * 32 == ckv_dim")
    latent8, rope8, valid8 = _gather_fp8(ckv8_cache, ckv8_scale, kpe8_cache, indices8)
    latent4, rope4, valid4 = _gather_fp4(ckv4_cache, ckv4_scale, kpe4_cache, indices4)
    latent = torch.cat((latent8, latent4), dim=1)
    rope = torch.cat((rope8, rope4), dim=1)
    valid = torch.cat((valid8, valid4), dim=1)
    logits = (torch.einsum("bhd,btd->bht", q_nope.to(torch.float32), latent)
              + torch.einsum("bhd,btd->bht", q_pe.to(torch.float32), rope)) * sm_scale
    output, lse = _attend(logits, valid, attn_sink.to(torch.float32), latent)
    return output.to(torch.bfloat16), lse
