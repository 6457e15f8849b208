"""MoE router top-k (``CPURouter.select_experts``) and SwiGLU experts (``cpu_fused_moe``).

The router is replicated under TP (every rank routes every token), so rank 0's call is
the logical one; its (weight, id) pairs come in the kernel's order and are put in the
definitions' canonical order. The experts are sharded along the intermediate size and
each rank writes a partial sum into ``out`` (reduced by the engine afterwards): w13's gate
and up halves and w2's columns are gathered, and the partial outputs summed in float32.
vLLM CPU prepacks expert weights per ISA and may zero-pad the intermediate size; both are
undone (:mod:`.packing`).
"""

from __future__ import annotations

from typing import Any

import torch

from enginetap.capture.probe import Extracted, Probe, ProbeCall
from enginetap.core.scope import current_module
from enginetap.dataset.schema import Definition
from enginetap.definitions.moe import canonical_routing
from enginetap.engines.vllm.probes.common import (DTYPES, gather, instantiate, is_writer,
                                                   other_rank, summed, tp_world)
from enginetap.engines.vllm.probes.packing import moe_weight_unpacker, unpack

__all__ = ["MOE_PROBES", "MOE_TARGETS", "canonical_routing"]

_MOE = "vllm.model_executor.layers.fused_moe"
ROUTER = f"{_MOE}.router.cpu_router:CPURouter.select_experts"
EXPERTS = f"{_MOE}.experts.cpu_moe:cpu_fused_moe"
MOE_TARGETS = (ROUTER, f"{_MOE}.router.cpu_router:CPURouter._compute_routing",
               f"{_MOE}.router.cpu_router:_grouped_topk",
               f"{_MOE}.router.cpu_router:_softmax_topk", EXPERTS,
               f"{_MOE}.experts.cpu_moe:CPUUnquantizedExperts.apply",
               f"{_MOE}.experts.cpu_moe:CPUUnquantizedExperts._pad_moe_intermediate",
               "vllm._custom_ops:cpu_prepack_moe_weight")


# ----------------------------------------------------------------------------- router
def _define_router(call: ProbeCall) -> Definition | None:
    router, logits = call.instance, call.args["router_logits"]
    if getattr(router, "custom_routing_function", None) is not None or logits.dim() != 2:
        return None
    dtype = DTYPES.get(logits.dtype)
    experts, top_k = int(logits.shape[1]), int(router.top_k)
    if dtype is None or getattr(router, "eplb_state", None) is not None:
        return None
    renormalize = bool(router.renormalize)
    if (router.use_grouped_topk and router.scoring_func == "sigmoid"
            and router.e_score_correction_bias is not None):
        return instantiate("moe_topk_grouped_sigmoid", num_experts=experts, top_k=top_k,
                           n_group=int(router.num_expert_group),
                           topk_group=int(router.topk_group), renormalize=renormalize,
                           routed_scaling_factor=float(router.routed_scaling_factor),
                           logits_dtype=dtype)
    if not router.use_grouped_topk and router.scoring_func == "softmax":
        return instantiate("moe_topk_softmax", num_experts=experts, top_k=top_k,
                           renormalize=renormalize, logits_dtype=dtype, rounding="each_op")
    return None


def _adapt_router(call: ProbeCall) -> Extracted:
    if not is_writer(call):
        return other_rank()
    weights, ids = call.result
    weights, ids = canonical_routing(weights.float(), ids)
    inputs: dict[str, Any] = {"router_logits": call.args["router_logits"]}
    bias = getattr(call.instance, "e_score_correction_bias", None)
    if call.definition is not None and "e_score_correction_bias" in call.definition.inputs:
        inputs["e_score_correction_bias"] = bias.detach().float()
    notes = ["(weight, id) pairs sorted into canonical order (descending weight, then "
             "ascending id); the kernel returns them unsorted",
             "router replicated on every TP rank: rank 0's call is the logical one"]
    return Extracted(inputs, {"topk_weights": weights, "topk_ids": ids}, notes)


# ----------------------------------------------------------------------------- experts
def _intermediate(w2: torch.Tensor) -> tuple[int, int]:
    """(real, padded) per-rank intermediate size of this MoE layer's experts."""
    padded = int(w2.shape[2])
    module = current_module()
    config = getattr(module, "moe_config", None)
    real = getattr(config, "intermediate_size_per_partition", None)
    real = getattr(module, "intermediate_size_per_partition", real)
    return (int(real) if real else padded), padded


def _define_experts(call: ProbeCall) -> Definition | None:
    args = call.args
    x, w13, w2 = args["input"], args["w13"], args["w2"]
    if (args.get("w13_bias") is not None or args.get("w2_bias") is not None
            or str(args["act"]).lower() != "silu" or args.get("skip_weighted")
            or x.dtype != torch.bfloat16 or w13.dtype != torch.bfloat16 or x.dim() != 2):
        return None
    real, _ = _intermediate(w2)
    inter = real * tp_world(call)
    return instantiate("moe_experts_swiglu", num_experts=int(w13.shape[0]),
                       hidden_size=int(x.shape[1]), intermediate_size=inter,
                       gemm1_out_size=2 * inter, top_k=int(args["topk_ids"].shape[1]))


def _plain_weights(call: ProbeCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's unpacked (gate, up, w2), padding dropped."""
    w13, w2, isa = call.args["w13"], call.args["w2"], str(call.args["isa"])
    real, padded = _intermediate(w2)
    experts, rows, hidden = w13.shape
    plain13 = unpack(w13, moe_weight_unpacker(isa, rows, hidden, w13.dtype), (rows, hidden))
    plain2 = unpack(w2, moe_weight_unpacker(isa, hidden, padded, w2.dtype), (hidden, padded))
    return plain13[:, :real], plain13[:, padded:padded + real], plain2[:, :, :real]


def _adapt_experts(call: ProbeCall) -> Extracted:
    gate, up, w2 = _plain_weights(call)
    parts = [gather(call, gate, 1), gather(call, up, 1), gather(call, w2, 2),
             summed(call, call.args["out"])]
    if parts[0] is None:
        return other_rank()
    gate, up, w2, out = parts
    args = call.args
    inputs = {"hidden_states": args["input"], "w13": torch.cat([gate, up], dim=1),
              "w2": w2, "topk_weights": args["topk_weights"].float(),
              "topk_ids": args["topk_ids"].to(torch.int32)}
    notes = [f"expert weights unpacked from vLLM CPU's {args['isa']} prepacked layout",
             "output read from the kernel's `out` argument after the call"]
    real, padded = _intermediate(args["w2"])
    if real != padded:
        notes.append(f"intermediate zero-padding {real} -> {padded} dropped")
    world = tp_world(call)
    if world > 1:
        notes.append(f"TP={world}: gate/up rows and w2 columns gathered in rank order; output "
                     "= float32 sum of every rank's partial output (the engine's all-reduce)")
    return Extracted(inputs, {"output": out.to(args["input"].dtype)}, notes)


MOE_PROBES = [
    Probe("vllm.moe.router", "moe_topk", _define_router, _adapt_router, target=ROUTER,
          description="CPURouter.select_experts(hidden_states, router_logits)"),
    Probe("vllm.moe.experts", "moe_experts_swiglu", _define_experts, _adapt_experts,
          target=EXPERTS, description="cpu_fused_moe(out, input, w13, w2, ...) as imported "
                                      "by fused_moe/experts/cpu_moe.py"),
]
