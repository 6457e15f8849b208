import torch

_CHUNK_ELEMENTS = 1 << 24


@torch.no_grad()
def run(q_index, k_index, weights, key_start, key_end):
    num_tokens, num_keys = q_index.shape[0], k_index.shape[0]
    device = q_index.device
    keys = k_index.float()
    positions = torch.arange(num_keys, device=device)
    out = torch.full((num_tokens, index_topk), -1, dtype=torch.int32, device=device)
    all_scores = torch.empty((num_tokens, num_keys), dtype=torch.float32, device=device)
    # Tokens in chunks bound the [tokens, heads, keys] score block.
    step = max(1, _CHUNK_ELEMENTS // max(1, index_n_heads * num_keys))
    for lo in range(0, num_tokens, step):
        hi = min(lo + step, num_tokens)
        logits = torch.einsum("thd,kd->thk", q_index[lo:hi].float(), keys).relu()
        scores = torch.einsum("th,thk->tk", weights[lo:hi].float(), logits)
        start, end = key_start[lo:hi, None].long(), key_end[lo:hi, None].long()
        visible = (positions >= start) & (positions < end)
        scores = scores.masked_fill(~visible, float("-inf"))
        all_scores[lo:hi] = scores
        # Stable descending sort: among equal scores the lower key index comes first.
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :index_topk]
        slot = torch.arange(order.shape[1], device=device)
        chosen = torch.where(slot < visible.sum(dim=-1, keepdim=True), order, -1)
        out[lo:hi, : order.shape[1]] = chosen.to(torch.int32)
    return out, all_scores
