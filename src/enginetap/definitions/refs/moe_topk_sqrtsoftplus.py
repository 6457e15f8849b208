# DeepSeek-V4 router, bias-steered selection. `num_experts`, `top_k`, `routed_scaling_factor`
# and `logits_dtype` come from the generated header above.
import torch
import torch.nn.functional as F


def _canonical(weights, ids):
    # Rows in a fixed order (descending weight, then ascending expert id).
    ids, order = torch.sort(ids, dim=-1)
    weights = weights.gather(-1, order)
    weights, order = torch.sort(weights, dim=-1, descending=True, stable=True)
    return weights, ids.gather(-1, order)


@torch.no_grad()
def run(router_logits, e_score_correction_bias):
    scores = F.softplus(router_logits.float()).sqrt()
    biased = scores + e_score_correction_bias.float()
    # The stable descending sort keeps the lower expert id first among equal biased scores.
    ids = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(1, ids)
    weights = weights / weights.sum(dim=-1, keepdim=True) * routed_scaling_factor
    weights, ids = _canonical(weights, ids)
    return weights, ids.to(torch.int32)
