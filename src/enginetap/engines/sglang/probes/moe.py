"""MoE router top-k at SGLang's ``select_experts`` (``srt/layers/moe/topk.py``).

Every device's ``TopK`` forward ends in ``select_experts(hidden_states, router_logits,
topk_config, ...)`` (the CPU path without AMX kernels picks the torch forms of
SGLang's top-k, CUDA its fused kernels), so the probe wraps that function. Its
``(weights, ids)`` rows come in the engine's order and are put in the definitions'
canonical order. DeepSeek's routed scaling factor is in the weights only where SGLang
applies it there (``apply_routed_scaling_factor_on_output``); otherwise it scales the
experts' output later, and the definition is instantiated with 1. TP=1 only (the router
is replicated under TP anyway).

Grouped sigmoid routing (DeepSeek-V3) is captured only from float32 logits: SGLang's
torch form (``biased_grouped_topk_impl``) takes the sigmoid in the logits' dtype, and on
bf16 logits its weights differ from the definition's float32 sigmoid by ~2**-9 relative
(and a near-tie may pick another expert): a different operator, not captured as this one.
"""

from __future__ import annotations

from typing import Any

import torch

from enginetap.capture.probe import Extracted, Probe, ProbeCall
from enginetap.dataset.schema import Definition
from enginetap.engines.sglang.probes.common import DTYPES, instantiate, single_rank

__all__ = ["MOE_PROBES", "MOE_TARGETS", "canonical_routing"]

_TOPK = "sglang.srt.layers.moe.topk"
ROUTER = f"{_TOPK}:select_experts"
MOE_TARGETS = (ROUTER, f"{_TOPK}:TopK.forward_cpu", f"{_TOPK}:biased_grouped_topk_impl",
               f"{_TOPK}:fused_topk_torch_native", f"{_TOPK}:TopKConfig")


def canonical_routing(weights: torch.Tensor, ids: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows in the definitions' order: descending weight, then ascending expert id."""
    ids_sorted, order = torch.sort(ids.to(torch.int64), dim=-1)
    weights = weights.gather(-1, order)
    weights, order = torch.sort(weights, dim=-1, descending=True, stable=True)
    return weights, ids_sorted.gather(-1, order).to(torch.int32)


def _define(call: ProbeCall) -> Definition | None:
    args = call.args
    config, logits = args["topk_config"], args["router_logits"]
    if (config.custom_routing_function is not None or logits.dim() != 2
            or getattr(config, "num_shared_topk_slots", 0)
            or args.get("dynamic_expert_bias") is not None
            or args.get("expert_location_dispatch_info") is not None
            or call.step.world_size != 1):
        return None
    dtype = DTYPES.get(logits.dtype)
    if dtype is None:
        return None
    experts, top_k = int(logits.shape[1]), int(config.top_k)
    renormalize = bool(config.renormalize)
    if config.use_grouped_topk and config.scoring_func == "sigmoid" \
            and config.correction_bias is not None and logits.dtype == torch.float32:
        scale = (float(config.routed_scaling_factor or 1.0)
                 if config.apply_routed_scaling_factor_on_output else 1.0)
        return instantiate("moe_topk_grouped_sigmoid", num_experts=experts, top_k=top_k,
                           n_group=int(config.num_expert_group),
                           topk_group=int(config.topk_group), renormalize=renormalize,
                           routed_scaling_factor=scale, logits_dtype=dtype)
    if not config.use_grouped_topk and config.scoring_func == "softmax":
        return instantiate("moe_topk_softmax", num_experts=experts, top_k=top_k,
                           renormalize=renormalize, logits_dtype=dtype)
    return None


def _adapt(call: ProbeCall) -> Extracted:
    single_rank(call)
    weights, ids = call.result[0], call.result[1]
    tokens = call.args["router_logits"].shape[0]
    weights, ids = canonical_routing(weights[:tokens].float(), ids[:tokens])
    inputs: dict[str, Any] = {"router_logits": call.args["router_logits"]}
    if call.definition is not None and "e_score_correction_bias" in call.definition.inputs:
        inputs["e_score_correction_bias"] = call.args["topk_config"].correction_bias.float()
    notes = ["(weight, id) pairs sorted into canonical order (descending weight, then "
             "ascending id); the engine returns them in its own order"]
    return Extracted(inputs, {"topk_weights": weights, "topk_ids": ids}, notes)


MOE_PROBES = [
    Probe("sglang.moe.router", "moe_topk", _define, _adapt, target=ROUTER,
          description="select_experts(hidden_states, router_logits, topk_config)"),
]
