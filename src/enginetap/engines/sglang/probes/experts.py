"""Routed SwiGLU experts at SGLang's torch-native MoE (``srt/layers/moe/fused_moe_native.py``).

Without AMX kernels, SGLang's CPU path (``UnquantizedFusedMoEMethod.forward_cpu``) calls
``moe_forward_native(layer, x, topk_output, moe_runner_config)``, which the probe wraps: it
returns the weighted sum of the chosen experts' outputs, before any routed scaling factor
or shared expert (those are applied by the model's MoE block afterwards). Its rounding, read
off the code and confirmed by counting exact elements against every scheme on captured
workloads (``tests/engines/sglang/test_sglang_capture.py``): ``F.linear`` in bf16 (gate_up
rounded), ``SiluAndMul.forward_native`` (silu(gate) and act rounded), ``F.linear`` (y
rounded), then ``y.type(weights.dtype) * weights`` and the sum over pairs in the weights'
dtype, cast to bf16 once: with float32 weights (what SGLang's routers return) that is
``each_op_f32_weighting``, with bf16 weights ``each_op``. With AMX kernels SGLang calls
``fused_experts_cpu`` instead, and on CUDA its Triton / FlashInfer kernels: neither is probed.
TP=1 (EP off) only.
"""

from __future__ import annotations

import torch

from enginetap.capture.probe import Extracted, Probe, ProbeCall
from enginetap.dataset.schema import Definition
from enginetap.engines.sglang.probes.common import DTYPES, instantiate, single_rank

__all__ = ["EXPERT_PROBES", "EXPERT_TARGETS"]

EXPERTS = "sglang.srt.layers.moe.fused_moe_native:moe_forward_native"
EXPERT_TARGETS = (EXPERTS,
                  "sglang.srt.layers.quantization.unquant:UnquantizedFusedMoEMethod.forward_cpu",
                  "sglang.srt.layers.activation:SiluAndMul.forward_native",
                  "sglang.srt.layers.activation:SiluAndMul.forward_cpu")

_ROUNDING = {torch.float32: "each_op_f32_weighting", torch.bfloat16: "each_op"}


def _define(call: ProbeCall) -> Definition | None:
    layer, x, config = call.args["layer"], call.args["x"], call.args["moe_runner_config"]
    weights, ids = call.args["topk_output"][0], call.args["topk_output"][1]
    w13, w2 = getattr(layer, "w13_weight", None), getattr(layer, "w2_weight", None)
    if (call.step.world_size != 1 or not isinstance(w13, torch.Tensor)
            or not isinstance(w2, torch.Tensor) or w13.dim() != 3 or x.dim() != 2
            or w13.dtype != torch.bfloat16 or x.dtype != torch.bfloat16
            or getattr(config, "activation", None) != "silu"
            or getattr(config, "gemm1_alpha", None) is not None
            or getattr(config, "apply_router_weight_on_input", False)
            or getattr(layer, "w13_weight_bias", None) is not None
            or getattr(layer, "w2_weight_bias", None) is not None):
        return None
    experts, two_i, hidden = (int(d) for d in w13.shape)
    rounding = _ROUNDING.get(weights.dtype)
    if (rounding is None or two_i % 2 or tuple(w2.shape) != (experts, hidden, two_i // 2)
            or int(getattr(layer, "num_experts", experts)) != experts
            or ids.dim() != 2 or tuple(weights.shape) != tuple(ids.shape)
            or ids.shape[0] != x.shape[0] or DTYPES.get(weights.dtype) is None):
        return None
    return instantiate("moe_experts_swiglu", num_experts=experts, hidden_size=hidden,
                       intermediate_size=two_i // 2, gemm1_out_size=two_i,
                       top_k=int(ids.shape[1]), rounding=rounding)


def _adapt(call: ProbeCall) -> Extracted:
    single_rank(call)
    layer = call.args["layer"]
    weights, ids = call.args["topk_output"][0], call.args["topk_output"][1]
    notes = ["w13 = layer.w13_weight [experts, 2*intermediate, hidden] (gate rows first), "
             "w2 = layer.w2_weight [experts, hidden, intermediate]: the engine's own layout; "
             "the output is moe_forward_native's return, before the routed scaling factor "
             "and any shared expert",
             f"topk_ids: {ids.dtype} -> int32"]
    if weights.dtype != torch.float32:
        notes.append(f"topk_weights: {DTYPES.get(weights.dtype)} as the engine passed them, "
                     "widened to float32 without loss")
    inputs = {"hidden_states": call.args["x"], "w13": layer.w13_weight.detach(),
              "w2": layer.w2_weight.detach(), "topk_weights": weights.float(),
              "topk_ids": ids.to(torch.int32)}
    return Extracted(inputs, {"output": call.result}, notes)


EXPERT_PROBES = [
    Probe("sglang.moe.experts", "moe_experts_swiglu", _define, _adapt, target=EXPERTS,
          description="moe_forward_native(layer, x, topk_output, moe_runner_config)"),
]
