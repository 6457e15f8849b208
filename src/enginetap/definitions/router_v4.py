"""DeepSeek-V4-style MoE routers: sqrt(softplus) scores, bias-steered or hash-routed selection.

Neither older router family fits them: the score is ``sqrt(softplus(logit))`` (not a softmax
or a sigmoid), there are no expert groups, weights always renormalise to
``routed_scaling_factor``, and some layers pick their experts from a per-token-id hash table
instead of from the scores. vLLM 0.32's CPU router runs both as ``_sqrtsoftplus_bias_topk``
(fused_moe/router/cpu_router.py) over the SGLang-derived kernels ``biased_topk_cpu`` and
``hash_topk_cpu`` (present only in the AVX-512 builds of vLLM CPU).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from enginetap.dataset.schema import Definition
from enginetap.definitions.base import CompareRule, Template, Tensor, const, var
from enginetap.definitions.moe import ROUTER_ORDER, ROUTER_OUTPUTS

if TYPE_CHECKING:
    import torch

__all__ = ["TOPK_SQRTSOFTPLUS", "TOPK_SQRTSOFTPLUS_HASH"]


def _logits(definition: Definition, axes: Mapping[str, int], gen: torch.Generator,
            device: str) -> torch.Tensor:
    import torch

    n, e = axes["num_tokens"], definition.const_axes["num_experts"]
    dtype = getattr(torch, definition.inputs["router_logits"].dtype)
    return (torch.randn(n, e, generator=gen, device=device) * 2.0).to(dtype)


def _biased_inputs(definition: Definition, axes: Mapping[str, int], gen: torch.Generator,
                   device: str) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    e, k = definition.const_axes["num_experts"], definition.const_axes["top_k"]
    logits = _logits(definition, axes, gen, device)
    # Experts 2j and 2j+1 share a bias, so equal logits give equal biased scores: every
    # third row copies the logit of its k-th best expert onto that expert's partner, an
    # exact tie that the lower expert id must win.
    bias = ((torch.rand((e + 1) // 2, generator=gen, device=device) - 0.5) * 0.2)
    bias = bias.repeat_interleave(2)[:e]
    if k < e and e > 1:
        biased = F.softplus(logits.float()).sqrt() + bias
        kth = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, k - 1]
        rows = torch.arange(1, logits.shape[0], 3, device=device)
        partner = torch.minimum(kth[rows] ^ 1, torch.tensor(e - 1, device=device))
        logits[rows, partner] = logits[rows, kth[rows]]
    return {"router_logits": logits, "e_score_correction_bias": bias.float()}


def _hash_inputs(definition: Definition, axes: Mapping[str, int], gen: torch.Generator,
                 device: str) -> dict[str, Any]:
    import torch

    n = axes["num_tokens"]
    e, k = definition.const_axes["num_experts"], definition.const_axes["top_k"]
    ids = torch.rand(n, e, generator=gen, device=device).argsort(dim=-1)[:, :k]
    return {"router_logits": _logits(definition, axes, gen, device),
            "expert_ids": ids.to(torch.int32)}


def _axes(consts: Mapping[str, int], index: int) -> dict[str, int]:
    return {"num_tokens": (16, 5, 1, 33)[index % 4]}


_WEIGHTS = ("Weights: w = sqrt(softplus(router_logits)) in float32 for the chosen experts, "
            "divided by their sum and multiplied by routed_scaling_factor (always "
            "renormalised, so the weights of a row sum to routed_scaling_factor).")
_AXES = {"num_tokens": var("Tokens routed in this call."),
         "num_experts": const("Routed experts."),
         "top_k": const("Experts chosen per token.")}
_LOGITS = Tensor(("num_tokens", "num_experts"), "{logits_dtype}", "Gate logits, one per expert.")

# What the two DeepSeek-V4 router families share besides their inputs and reference.
_SHARED: dict[str, Any] = dict(
    compare={"topk_ids": CompareRule(kind="selection"),
             "topk_weights": CompareRule(atol=1e-6, rtol=1e-5, paired_with="topk_ids")},
    params={"routed_scaling_factor": 1.0, "logits_dtype": "float32"},
    choices={"logits_dtype": ("float32", "bfloat16")},
    constraints=("top_k <= num_experts",),
    tags=("stage:moe_router",),
    engines=("vllm",),
    example={"num_experts": 16, "top_k": 4, "routed_scaling_factor": 1.5},
    example_axes={"num_tokens": 16},
    workload_axes=_axes,
)

TOPK_SQRTSOFTPLUS = Template(
    family="moe_topk_sqrtsoftplus",
    op_type="moe_router",
    name="moe_topk_sqrtsoftplus_e{num_experts}_topk{top_k}_rs{routed_scaling_factor:g}"
         "_{logits_dtype}",
    description=(
        "DeepSeek-V4 router, bias-steered layers: score = sqrt(softplus(router_logits)) in "
        "float32; the top_k experts by score + e_score_correction_bias are chosen (no expert "
        "groups; equal biased scores go to the lower expert id). " + _WEIGHTS + " The bias "
        "steers selection only. " + ROUTER_ORDER + " Engine mapping: vLLM CPU "
        "`CPURouter.select_experts` with scoring_func 'sqrtsoftplus' -> "
        "`_sqrtsoftplus_bias_topk(router_logits, top_k, renormalize=True, "
        "e_score_correction_bias, routed_scaling_factor, input_ids, None)` (its gating input "
        "is read as float32)."),
    axes=_AXES,
    inputs={"router_logits": _LOGITS,
            "e_score_correction_bias": Tensor(("num_experts",), "float32",
                                              "Per-expert bias added for selection only.")},
    outputs=ROUTER_OUTPUTS,
    reference="moe_topk_sqrtsoftplus.py",
    generate=_biased_inputs,
    **_SHARED,
)

TOPK_SQRTSOFTPLUS_HASH = Template(
    family="moe_topk_sqrtsoftplus_hash",
    op_type="moe_router",
    name="moe_topk_sqrtsoftplus_hash_e{num_experts}_topk{top_k}_rs{routed_scaling_factor:g}"
         "_{logits_dtype}",
    description=(
        "DeepSeek-V4 router, hash-routed layers: the experts are given, expert_ids[t] = "
        "hash_indices_table[input_ids[t]] (the model's table row of the token id); the "
        "scores pick nothing. " + _WEIGHTS + " " + ROUTER_ORDER + " Engine mapping: vLLM CPU "
        "`_sqrtsoftplus_bias_topk(router_logits, top_k, True, None, routed_scaling_factor, "
        "input_ids, hash_indices_table)` with expert_ids = hash_indices_table[input_ids]."),
    axes=_AXES,
    inputs={"router_logits": _LOGITS,
            "expert_ids": Tensor(("num_tokens", "top_k"), "int32",
                                 "The token's experts from the hash table, distinct per row.")},
    outputs=ROUTER_OUTPUTS,
    reference="moe_topk_sqrtsoftplus_hash.py",
    generate=_hash_inputs,
    **_SHARED,
)
