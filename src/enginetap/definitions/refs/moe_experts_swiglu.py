import torch
import torch.nn.functional as F


def _bf16(t):
    return t.to(torch.bfloat16).float()


def _same(t):
    return t


@torch.no_grad()
def run(hidden_states, w13, w2, topk_weights, topk_ids):
    x = hidden_states.float()
    # Where each scheme rounds to bf16 (see the description): the ops' results, the
    # weighted outputs, and the running sum of a token's pairs.
    op = _same if rounding == "act" else _bf16
    weighted_op = _bf16 if rounding in ("each_op", "each_op_bf16_sum") else _same
    bf16_sum = rounding == "each_op_bf16_sum"
    out = torch.zeros(x.shape[0], hidden_size, dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    # Ascending expert id: the order in which 'each_op_bf16_sum' adds and rounds.
    for expert in torch.unique(ids).tolist():
        tokens, slots = torch.nonzero(ids == expert, as_tuple=True)
        gate_up = op(x[tokens] @ w13[expert].float().T)
        gate, up = gate_up[:, :intermediate_size], gate_up[:, intermediate_size:]
        # The activation is rounded to bf16 before the down projection in every scheme.
        act = _bf16(op(F.silu(gate)) * up)
        down = op(act @ w2[expert].float().T)
        weighted = weighted_op(down * topk_weights[tokens, slots].float().unsqueeze(-1))
        if bf16_sum:
            out[tokens] = _bf16(out[tokens] + weighted)
        else:
            out.index_add_(0, tokens, weighted)
    return out.to(hidden_states.dtype)
