import math

import torch

_CHUNK_ELEMENTS = 1 << 23


def _refuse_duplicates(indices, valid, what):
    # The contract wants distinct slots per row (engines' top-k selections are): a gather
    # kernel would attend a repeated slot twice, a mask kernel once, so neither is right.
    placeholder = -1 - torch.arange(indices.shape[-1], device=indices.device)
    ordered = torch.where(valid, indices.long(), placeholder).sort(dim=-1).values
    if bool((ordered[..., 1:] == ordered[..., :-1]).any()):
        raise ValueError(f"{what}: a row lists the same slot twice; rows must be distinct")


@torch.no_grad()
def run(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale):
    num_tokens = q_nope.shape[0]
    device = q_nope.device
    ckv = ckv_cache.reshape(-1, head_dim_ckv).float()
    kpe = kpe_cache.reshape(-1, head_dim_kpe).float()
    valid = sparse_indices != -1
    rows = sparse_indices.long().clamp(min=0)
    _refuse_duplicates(sparse_indices, valid, "sparse_indices")
    scale = float(sm_scale)
    output = torch.empty(num_tokens, num_qo_heads, head_dim_ckv, dtype=torch.bfloat16,
                         device=device)
    lse = torch.empty(num_tokens, num_qo_heads, dtype=torch.float32, device=device)
    # Tokens in chunks bound the gathered [tokens, topk, head_dim_ckv] block.
    step = max(1, _CHUNK_ELEMENTS // (topk * head_dim_ckv))
    for lo in range(0, num_tokens, step):
        hi = min(lo + step, num_tokens)
        # Padding reads slot 0 as a placeholder: zero it, so that a non-finite value there
        # (0 * NaN = NaN) cannot reach a row that does not attend slot 0.
        keep = valid[lo:hi, :, None]
        kc = torch.where(keep, ckv[rows[lo:hi]], 0.0)
        kp = torch.where(keep, kpe[rows[lo:hi]], 0.0)
        logits = torch.einsum("thd,tkd->thk", q_nope[lo:hi].float(), kc)
        logits = (logits + torch.einsum("thd,tkd->thk", q_pe[lo:hi].float(), kp)) * scale
        mask = valid[lo:hi, None, :]
        logits = logits.masked_fill(~mask, float("-inf"))
        row_lse = torch.logsumexp(logits, dim=-1)
        # A row without any valid index has lse -inf and outputs zeros (no NaN).
        probs = torch.where(mask, torch.exp(logits - row_lse.unsqueeze(-1)), 0.0)
        output[lo:hi] = torch.einsum("thk,tkd->thd", probs, kc).to(torch.bfloat16)
        lse[lo:hi] = row_lse / math.log(2.0)
    return output, lse
