import torch


def _top(scores, k):
    # Indices of the k largest entries per row; the stable descending sort keeps the
    # lower index first among equal scores.
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def _canonical(weights, ids):
    # Rows in a fixed order (descending weight, then ascending expert id).
    ids, order = torch.sort(ids, dim=-1)
    weights = weights.gather(-1, order)
    weights, order = torch.sort(weights, dim=-1, descending=True, stable=True)
    return weights, ids.gather(-1, order)


@torch.no_grad()
def run(router_logits, e_score_correction_bias):
    num_tokens = router_logits.shape[0]
    per_group = num_experts // n_group
    scores = torch.sigmoid(router_logits.float())
    biased = scores + e_score_correction_bias.float()
    # A group's score is the sum of its two best biased expert scores.
    group_scores = biased.view(num_tokens, n_group, per_group).topk(2, dim=-1).values.sum(dim=-1)
    kept = torch.zeros(num_tokens, n_group, dtype=torch.bool, device=biased.device)
    kept.scatter_(1, _top(group_scores, topk_group), True)
    candidates = biased.masked_fill(~kept.repeat_interleave(per_group, dim=1), float("-inf"))
    ids = _top(candidates, top_k)
    # The bias steers selection only: weights are the unbiased sigmoid scores.
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights * routed_scaling_factor
    weights, ids = _canonical(weights, ids)
    return weights, ids.to(torch.int32)
