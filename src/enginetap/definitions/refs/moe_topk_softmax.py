import torch


def _canonical(weights, ids):
    # Rows in a fixed order (descending weight, then ascending expert id), so that two
    # correct routings of the same logits list the same (id, weight) pairs in the same slots.
    ids, order = torch.sort(ids, dim=-1)
    weights = weights.gather(-1, order)
    weights, order = torch.sort(weights, dim=-1, descending=True, stable=True)
    return weights, ids.gather(-1, order)


def _weights(router_logits, ids):
    dtype = router_logits.dtype
    logits = router_logits.float()
    chosen = logits.gather(-1, ids)
    if rounding == "each_op":
        # Each op's result in the logits dtype, as vLLM CPU's _softmax_topk computes.
        if renormalize:
            return torch.softmax(chosen, dim=-1).to(dtype).float()
        # logsumexp = m + log(sum(exp(x - m))), m the row max, each op rounded (the sum
        # accumulated in float32).
        def op(t):
            return t.to(dtype).float()

        m = logits.amax(dim=-1, keepdim=True)
        total = op(op(op(logits - m).exp()).sum(dim=-1, keepdim=True))
        log_z = op(op(total.log()) + m)
        return op(op(chosen - log_z).exp())
    weights = torch.softmax(logits, dim=-1).gather(-1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    # 'output': the float32 weights rounded once to the logits dtype (transformers).
    return weights.to(dtype).float() if rounding == "output" else weights


@torch.no_grad()
def run(router_logits):
    # Selection ranks the logits themselves (softmax is monotonic); the stable descending
    # sort keeps the lower expert id first among equal logits.
    ids = torch.sort(router_logits.float(), dim=-1, descending=True, stable=True).indices
    ids = ids[:, :top_k]
    weights, ids = _canonical(_weights(router_logits, ids), ids)
    return weights, ids.to(torch.int32)
