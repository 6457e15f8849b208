# DeepSeek-V4 router, hash-routed layers: the experts come from the model's hash table.
# `num_experts`, `top_k`, `routed_scaling_factor` and `logits_dtype` come from the header above.
import torch
import torch.nn.functional as F


def _canonical(weights, ids):
    # Rows in a fixed order (descending weight, then ascending expert id).
    ids, order = torch.sort(ids, dim=-1)
    weights = weights.gather(-1, order)
    weights, order = torch.sort(weights, dim=-1, descending=True, stable=True)
    return weights, ids.gather(-1, order)


@torch.no_grad()
def run(router_logits, expert_ids):
    ids = expert_ids.long()
    if bool(((ids < 0) | (ids >= num_experts)).any()):
        raise ValueError(f"expert_ids must lie in [0, {num_experts})")
    weights = F.softplus(router_logits.float()).sqrt().gather(1, ids)
    weights = weights / weights.sum(dim=-1, keepdim=True) * routed_scaling_factor
    weights, ids = _canonical(weights, ids)
    return weights, ids.to(torch.int32)
