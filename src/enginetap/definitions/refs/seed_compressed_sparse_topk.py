"""Top-k selection of compressed key blocks for sparse attention (block-level indexer).

The context is cut into blocks of ``block_size`` tokens; the cache keeps one compressed key
per complete block. Logical block ``b`` of token ``t`` lives at
``kc_cache[page_table[t, b // page_size], b % page_size]``. Token ``t`` sees the tokens
before ``seq_lens[t]`` (its position + 1), hence blocks ``b < seq_lens[t] // block_size``;
page-table entries past those are never read.

Score of a visible block: ``sum_h weights[t, h] * f(q[t, h] . kc[b])`` in float32, with
``f = relu`` when the parameter ``relu`` is true, else the identity. ``block_ids[t]`` holds
the ``min(topk, visible)`` best-scoring blocks in increasing block order, then ``-1``
padding. Ties go to the lower block id. ``scores[t, p, s]`` is the score of logical block
``p * page_size + s`` (``-inf`` for blocks the token does not see).
"""

import torch


def _token(q, weights, kc, pages, visible):
    blocks = torch.arange(visible, device=q.device)
    physical = pages[blocks // page_size].long()
    if bool(((physical < 0) | (physical >= kc.shape[0])).any()):
        raise ValueError("page_table: a visible block maps to no page of kc_cache")
    keys = kc[physical, blocks % page_size].to(torch.float32)
    dots = keys @ q.to(torch.float32).T
    if relu:
        dots = dots.clamp(min=0.0)
    return dots @ weights.to(torch.float32)


def _select(row, count):
    # A stable descending sort keeps equal scores in block order: ties go to lower ids.
    order = torch.sort(row, descending=True, stable=True).indices[:count]
    return order.sort().values


def run(q, weights, kc_cache, page_table, seq_lens):
    num_tokens, max_pages = page_table.shape
    scores = torch.full((num_tokens, max_pages * page_size), float("-inf"),
                        dtype=torch.float32, device=q.device)
    block_ids = torch.full((num_tokens, topk), -1, dtype=torch.int32, device=q.device)
    visible = (seq_lens.long() // block_size).clamp(min=0)
    if bool((visible > max_pages * page_size).any()):
        raise ValueError("seq_lens: a token sees more blocks than its page_table row holds")
    for t, count in enumerate(visible.tolist()):
        if count == 0:
            continue
        row = _token(q[t], weights[t], kc_cache, page_table[t], count)
        scores[t, :count] = row
        chosen = _select(row, min(topk, count))
        block_ids[t, :chosen.numel()] = chosen.to(torch.int32)
    return block_ids, scores.reshape(num_tokens, max_pages, page_size)
