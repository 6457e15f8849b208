import torch


def _canonical(weights, ids):
    # Rows in a fixed order (descending weight, then ascending expert id), so that two
    # correct routings of the same logits list the same (id, weight) pairs in the same slots.
    ids, order = torch.sort(ids, dim=-1)
    weights = weights.gather(-1, order)
    weights, order = torch.sort(weights, dim=-1, descending=True, stable=True)
    return weights, ids.gather(-1, order)


@torch.no_grad()
def run(router_logits):
    logits = router_logits.float()
    # Selection ranks the logits themselves (softmax is monotonic); the stable descending
    # sort keeps the lower expert id first among equal logits.
    ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = torch.softmax(logits, dim=-1).gather(-1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights, ids = _canonical(weights, ids)
    return weights, ids.to(torch.int32)
