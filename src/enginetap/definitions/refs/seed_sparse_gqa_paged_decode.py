"""GQA decode that attends only the token blocks a sparse indexer selected.

Block ``b`` covers tokens ``b * block_size .. (b + 1) * block_size - 1`` of its sequence;
token ``i`` of sequence ``s`` lives at ``[page_table[s, i // page_size], i % page_size]`` of
``k_cache`` / ``v_cache``. Query head ``h`` uses KV head ``g = h // (num_qo_heads //
num_kv_heads)`` and attends the tokens of the blocks in ``block_ids[s, g]`` (or
``block_ids[s, 0]`` for every head when ``sel_heads == 1``) that lie before
``seq_lens[s]``; ``-1`` entries are padding. The valid blocks of a selection must be
distinct (a repeated block is refused). A sequence's output depends only on the cache slots
it attends.
``lse`` is the base-2 log-sum-exp of the scaled logits (``-inf`` when nothing is attended;
the output is then zero).
"""

import math

import torch


def _refuse_duplicates(indices, valid, what):
    # The contract wants distinct slots per row (engines' top-k selections are): a gather
    # kernel would attend a repeated slot twice, a mask kernel once, so neither is right.
    placeholder = -1 - torch.arange(indices.shape[-1], device=indices.device)
    ordered = torch.where(valid, indices.long(), placeholder).sort(dim=-1).values
    if bool((ordered[..., 1:] == ordered[..., :-1]).any()):
        raise ValueError(f"{what}: a row lists the same slot twice; rows must be distinct")


def _tokens(ids, length):
    """Token positions ``[sel, topk * block_size]`` and their validity."""
    offsets = torch.arange(block_size, device=ids.device)
    tokens = (ids.long()[..., None] * block_size + offsets).flatten(-2)
    valid = (ids[..., None] >= 0).expand(*ids.shape, block_size).flatten(-2) & (tokens < length)
    return torch.where(valid, tokens, torch.zeros_like(tokens)), valid


def _sequence(q, k_flat, v_flat, pages, ids, length, sm_scale):
    tokens, valid = _tokens(ids, length)
    physical = pages[tokens // page_size].long()
    if bool(((physical < 0) | (physical * page_size >= k_flat.shape[0]))[valid].any()):
        raise ValueError("page_table: an attended token maps to no page of the cache")
    slot = torch.where(valid, physical * page_size + tokens % page_size, torch.zeros_like(tokens))
    heads = torch.arange(num_kv_heads, device=q.device)
    if ids.shape[0] == 1:
        slot, valid = slot.expand(num_kv_heads, -1), valid.expand(num_kv_heads, -1)
    # Unattended entries read slot 0 as a placeholder: zero them, so that a non-finite value
    # there (0 * NaN = NaN) cannot reach a sequence that does not attend slot 0.
    keep = valid[..., None]
    keys = torch.where(keep, k_flat[slot, heads[:, None]].to(torch.float32), 0.0)  # [kv, L, D]
    values = torch.where(keep, v_flat[slot, heads[:, None]].to(torch.float32), 0.0)
    grouped = q.to(torch.float32).reshape(num_kv_heads, -1, head_dim)
    logits = torch.einsum("gqd,gld->gql", grouped, keys) * sm_scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    shift = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(logits - shift[..., None])
    output = torch.einsum("gql,gld->gqd", probs, values)
    return output.reshape(num_qo_heads, head_dim), lse.reshape(num_qo_heads) / math.log(2.0)


def run(q, k_cache, v_cache, page_table, seq_lens, block_ids, sm_scale):
    if num_qo_heads % num_kv_heads or block_ids.shape[1] not in (1, num_kv_heads):
        raise ValueError("need num_qo_heads % num_kv_heads == 0 and sel_heads in "
                         f"(1, num_kv_heads={num_kv_heads}), got sel_heads={block_ids.shape[1]}")
    if bool((seq_lens > page_table.shape[1] * page_size).any()):
        raise ValueError("seq_lens: a sequence is longer than its page_table row holds")
    k_flat = k_cache.reshape(-1, num_kv_heads, head_dim)
    _refuse_duplicates(block_ids, block_ids >= 0, "block_ids")
    v_flat = v_cache.reshape(-1, num_kv_heads, head_dim)
    outputs, lses = [], []
    for s in range(q.shape[0]):
        output, lse = _sequence(q[s], k_flat, v_flat, page_table[s], block_ids[s],
                                int(seq_lens[s]), sm_scale)
        outputs.append(output)
        lses.append(lse)
    if not outputs:
        return (q.new_zeros(0, num_qo_heads, head_dim, dtype=torch.bfloat16),
                torch.zeros(0, num_qo_heads, device=q.device))
    return torch.stack(outputs).to(torch.bfloat16), torch.stack(lses).to(torch.float32)
