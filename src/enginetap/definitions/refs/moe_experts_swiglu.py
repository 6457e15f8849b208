import torch
import torch.nn.functional as F


@torch.no_grad()
def run(hidden_states, w13, w2, topk_weights, topk_ids):
    x = hidden_states.float()
    out = torch.zeros(x.shape[0], hidden_size, dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    for expert in torch.unique(ids).tolist():
        tokens, slots = torch.nonzero(ids == expert, as_tuple=True)
        gate_up = x[tokens] @ w13[expert].float().T
        gate, up = gate_up[:, :intermediate_size], gate_up[:, intermediate_size:]
        # The activation is stored in the activation dtype before the down projection,
        # as the engines' kernels do.
        act = (F.silu(gate) * up).to(hidden_states.dtype).float()
        down = act @ w2[expert].float().T
        out.index_add_(0, tokens, down * topk_weights[tokens, slots].float().unsqueeze(-1))
    return out.to(hidden_states.dtype)
