"""Sparse MLA prefill: each query token attends its own top-k latent slots, with a sink.

Token ``t`` attends the slots ``sparse_indices[t, j]`` for ``j < topk_lens[t]`` whose value
is not ``-1``; entries at ``j >= topk_lens[t]`` are ignored whatever they hold. A slot is
``page * page_size + offset`` into ``ckv_cache`` / ``kpe_cache`` (bf16). Logits are
``sm_scale * (q_nope . ckv + q_pe . kpe)``; the value of a slot is its ``ckv`` row. The sink
adds ``exp(attn_sink[h])`` to the softmax denominator and nothing to the numerator
(``-inf`` disables it). ``lse`` is the base-2 log-sum-exp of the attended logits, sink
excluded (``-inf`` when a token attends nothing; its output is then zero).
"""

import math

import torch

# Query tokens per step: bounds the gathered [chunk, topk, ckv_dim] float32 working set.
CHUNK = 64


def _refuse_duplicates(indices, valid, what):
    # The contract wants distinct slots per row (engines' top-k selections are): a gather
    # kernel would attend a repeated slot twice, a mask kernel once, so neither is right.
    placeholder = -1 - torch.arange(indices.shape[-1], device=indices.device)
    ordered = torch.where(valid, indices.long(), placeholder).sort(dim=-1).values
    if bool((ordered[..., 1:] == ordered[..., :-1]).any()):
        raise ValueError(f"{what}: a row lists the same slot twice; rows must be distinct")


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
    return numerator / safe[..., None], lse / math.log(2.0)


def _chunk(q_nope, q_pe, ckv, kpe, indices, lengths, sink, sm_scale):
    positions = torch.arange(indices.shape[1], device=indices.device)
    valid = (positions[None, :] < lengths[:, None]) & (indices >= 0)
    slot = torch.where(valid, indices, torch.zeros_like(indices)).long()
    # Unattended entries read slot 0 as a placeholder: zero them, so that a non-finite value
    # there (0 * NaN = NaN) cannot reach a token that does not attend slot 0.
    latent = torch.where(valid[..., None], ckv[slot].to(torch.float32), 0.0)
    rope = torch.where(valid[..., None], kpe[slot].to(torch.float32), 0.0)
    logits = (torch.einsum("thd,tkd->thk", q_nope.to(torch.float32), latent)
              + torch.einsum("thd,tkd->thk", q_pe.to(torch.float32), rope)) * sm_scale
    return _attend(logits, valid, sink, latent)


def run(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, topk_lens, attn_sink, sm_scale):
    ckv = ckv_cache.reshape(-1, ckv_dim)
    kpe = kpe_cache.reshape(-1, kpe_dim)
    positions = torch.arange(topk, device=sparse_indices.device)
    used = (positions[None, :] < topk_lens[:, None]) & (sparse_indices >= 0)
    _refuse_duplicates(sparse_indices, used, "sparse_indices")
    if bool((sparse_indices[used] >= ckv.shape[0]).any()):
        raise ValueError("sparse_indices: a slot index is beyond num_pages * page_size")
    sink = attn_sink.to(torch.float32)
    outputs, lses = [], []
    for start in range(0, q_nope.shape[0], CHUNK):
        part = slice(start, start + CHUNK)
        output, lse = _chunk(q_nope[part], q_pe[part], ckv, kpe, sparse_indices[part],
                             topk_lens[part].long(), sink, sm_scale)
        outputs.append(output)
        lses.append(lse)
    output = torch.cat(outputs) if outputs else q_nope.new_zeros(0, num_heads, ckv_dim)
    lse = torch.cat(lses) if lses else torch.zeros(0, num_heads, device=q_nope.device)
    return output.to(torch.bfloat16), lse.to(torch.float32)
