"""MoE probes of the built-in engine: routers and SwiGLU experts.

- ``*TopKRouter.forward`` (Qwen3-MoE, Qwen3-Next) → ``moe_topk_softmax``;
- ``*TopkRouter.forward`` (DeepSeek-V3/V3.2, GLM-4-MoE: sigmoid, bias, groups) →
  ``moe_topk_grouped_sigmoid``, with the router's own ``routed_scaling_factor`` (transformers
  scales inside the router; the catalog's ``engine="transformers"`` convention);
- ``*Experts.forward(hidden_states, top_k_index, top_k_weights)`` → ``moe_experts_swiglu``
  with ``w13 = gate_up_proj`` ([E, 2I, H], gate first) and ``w2 = down_proj`` ([E, H, I]);
  its ``rounding`` follows the model's experts implementation and routing-weight dtype.

Routers return ``(router_logits, weights, indices)`` over the flattened padded batch; the
router's logits are its own matmul's output, the definition's input.
"""

from __future__ import annotations

import torch

from enginetap.capture.probe import Extracted, Probe, ProbeCall
from enginetap.dataset.schema import Definition
from enginetap.definitions.moe import canonical_routing
from enginetap.engines.hf.probes.common import DTYPES, PAD_NOTE, instantiate, token_rows

__all__ = ["MOE_PROBES"]

_LOGITS_NOTE = ("router_logits: the router's own gate matmul output (the engine's router "
                "call computes logits and routing in one forward)")


def _router_outputs(call: ProbeCall, notes: list[str]) -> dict[str, torch.Tensor]:
    _, weights, ids = call.result
    if weights.dtype != torch.float32:
        notes.append(f"topk_weights: the engine returns {DTYPES.get(weights.dtype)}; widened "
                     "to float32 without loss")
    notes.append(f"topk_ids: {ids.dtype} -> int32; (weight, id) pairs sorted into canonical "
                 "order (descending weight, then ascending id), as the definition states")
    weights, ids = canonical_routing(token_rows(call, weights).float(), token_rows(call, ids))
    return {"topk_weights": weights, "topk_ids": ids}


def _define_softmax(call: ProbeCall) -> Definition | None:
    module = call.instance
    dtype = DTYPES.get(module.weight.dtype)
    if dtype is None:
        return None
    # The router computes in float32 and returns its weights in the logits dtype.
    return instantiate("moe_topk_softmax", num_experts=int(module.num_experts),
                       top_k=int(module.top_k), renormalize=bool(module.norm_topk_prob),
                       logits_dtype=dtype, rounding="output")


def _adapt_softmax(call: ProbeCall) -> Extracted:
    notes = [PAD_NOTE, _LOGITS_NOTE]
    logits = token_rows(call, call.result[0])
    return Extracted({"router_logits": logits}, _router_outputs(call, notes), notes)


def _define_grouped(call: ProbeCall) -> Definition | None:
    module = call.instance
    if not hasattr(module, "e_score_correction_bias"):
        return None
    return instantiate("moe_topk_grouped_sigmoid", num_experts=int(module.num_experts),
                       top_k=int(module.top_k), n_group=int(module.num_group),
                       topk_group=int(module.topk_group),
                       renormalize=bool(module.norm_topk_prob),
                       routed_scaling_factor=float(module.routed_scaling_factor),
                       logits_dtype="float32")


def _adapt_grouped(call: ProbeCall) -> Extracted | None:
    module = call.instance
    logits = token_rows(call, call.result[0])
    if logits.dtype != torch.float32:
        return None
    notes = [PAD_NOTE, _LOGITS_NOTE,
             f"routed_scaling_factor {float(module.routed_scaling_factor):g}: transformers "
             "applies it inside the router, so it is part of topk_weights"]
    bias = module.e_score_correction_bias.detach()
    if bias.dtype != torch.float32:
        notes.append(f"e_score_correction_bias: stored as {DTYPES.get(bias.dtype)} by the "
                     "engine (the model's dtype); widened to float32 without loss, the value "
                     "the router added")
    inputs = {"router_logits": logits, "e_score_correction_bias": bias.float()}
    return Extracted(inputs, _router_outputs(call, notes), notes)


def _define_experts(call: ProbeCall) -> Definition | None:
    module = call.instance
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    ids = call.args["top_k_index"]
    plain = (getattr(module, "has_gate", True) and getattr(module, "is_concatenated", True)
             and not getattr(module, "is_transposed", False)
             and not getattr(module, "has_bias", False))
    act = getattr(getattr(module, "config", None), "hidden_act", "silu")
    if (not plain or act != "silu" or not isinstance(gate_up, torch.Tensor)
            or gate_up.dim() != 3 or gate_up.dtype != torch.bfloat16):
        return None
    experts, two_i, hidden = (int(d) for d in gate_up.shape)
    rounding = _rounding(module, call.args["top_k_weights"])
    if tuple(down.shape) != (experts, hidden, two_i // 2) or rounding is None:
        return None
    return instantiate("moe_experts_swiglu", num_experts=experts, hidden_size=hidden,
                       intermediate_size=two_i // 2, gemm1_out_size=two_i,
                       top_k=int(ids.shape[-1]), rounding=rounding)


def _rounding(module: object, weights: torch.Tensor) -> str | None:
    """Where this experts module rounds (the family's ``rounding``), from the model's
    experts implementation and the routing weights' dtype; ``None``: a scheme no
    definition describes (hub kernels), so nothing is captured."""
    implementation = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if implementation == "eager":
        return "each_op_bf16_sum"  # index_add_ into a bf16 output, expert by expert
    if implementation in ("grouped_mm", "batched_mm"):
        # y * weight in the promoted dtype, then a float32 sum over the token's pairs.
        return "each_op" if weights.dtype == torch.bfloat16 else "each_op_f32_weighting"
    return None


def _adapt_experts(call: ProbeCall) -> Extracted:
    module = call.instance
    weights = token_rows(call, call.args["top_k_weights"])
    notes = [PAD_NOTE, "w13 = gate_up_proj [experts, 2*intermediate, hidden] (gate rows "
             "first), w2 = down_proj [experts, hidden, intermediate]: the engine's own layout",
             f"topk_ids: {call.args['top_k_index'].dtype} -> int32"]
    if weights.dtype != torch.float32:
        notes.append(f"topk_weights: {DTYPES.get(weights.dtype)} as the engine passed them, "
                     "widened to float32 without loss")
    inputs = {"hidden_states": token_rows(call, call.args["hidden_states"]),
              "w13": module.gate_up_proj.detach(), "w2": module.down_proj.detach(),
              "topk_weights": weights.float(),
              "topk_ids": token_rows(call, call.args["top_k_index"]).to(torch.int32)}
    return Extracted(inputs, {"output": token_rows(call, call.result)}, notes)


MOE_PROBES: list[Probe] = [
    Probe("hf.moe.router_softmax", "moe_topk_softmax", _define_softmax, _adapt_softmax,
          suffix="TopKRouter", description="*TopKRouter.forward (softmax top-k router)"),
    Probe("hf.moe.router_grouped", "moe_topk_grouped_sigmoid", _define_grouped,
          _adapt_grouped, suffix="TopkRouter",
          description="*TopkRouter.forward (DeepSeek grouped sigmoid router with bias)"),
    Probe("hf.moe.experts", "moe_experts_swiglu", _define_experts, _adapt_experts,
          suffix="Experts", description="*Experts.forward (routed SwiGLU experts)"),
]
