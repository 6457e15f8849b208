"""Mixture-of-experts families: softmax and grouped-sigmoid routers, SwiGLU experts.

Routers return ``(topk_weights float32, topk_ids int32)`` in one canonical order: each row
sorted by descending weight, ties by ascending expert id. Engines list their picks in any
order (vLLM's ``torch.topk(..., sorted=False)``), so capture sorts them
(:func:`canonical_routing`), ids are compared as sets and weights only after the engine's
``(id, weight)`` pairs are put into that same order.

Where the softmax router and the experts round to 16 bits differs by engine, so it is a
parameter and part of the name (``rounding``): see :data:`ROUTER_ROUNDING`,
:data:`EXPERT_ROUNDING` and the families' descriptions; ``tests/definitions/
test_contracts_moe.py`` counts exact matches per scheme on what the engines produce.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from enginetap.dataset.schema import Definition
from enginetap.definitions.base import CompareRule, Template, Tensor, const, var

if TYPE_CHECKING:
    import torch

__all__ = ["EXPERTS_SWIGLU", "EXPERT_ROUNDING", "ROUTER_ORDER", "ROUTER_OUTPUTS",
           "ROUTER_ROUNDING", "TOPK_GROUPED_SIGMOID", "TOPK_SOFTMAX", "canonical_routing"]

EXPERT_ROUNDING = ("act", "each_op", "each_op_f32_weighting", "each_op_bf16_sum")
"""Where ``moe_experts_swiglu`` rounds to bf16 (vLLM CPU's fused kernel; transformers' bf16 ops,
by experts implementation and routing-weight dtype): see the family's description."""

ROUTER_ROUNDING = ("none", "output", "each_op")
"""Where ``moe_topk_softmax`` rounds its weights to the logits dtype: see its description."""

ROUTER_ORDER = ("Rows are in canonical order: descending weight, ties by ascending expert id; "
          "selection ties (equal scores) go to the lower expert id. Replay compares "
          "topk_ids as sets and topk_weights after sorting the engine's (id, weight) pairs "
          "of each row into the same order.")


def canonical_routing(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor,
                                                                       torch.Tensor]:
    """A router's ``(weights, ids)`` rows in the routers' canonical order (descending weight,
    then ascending expert id): what capture stores, whatever order the engine listed."""
    import torch

    ids_sorted, order = torch.sort(ids.to(torch.int64), dim=-1)
    weights = weights.gather(-1, order)
    weights, order = torch.sort(weights, dim=-1, descending=True, stable=True)
    return weights, ids_sorted.gather(-1, order).to(torch.int32)


def _dtype(definition: Definition, name: str) -> torch.dtype:
    import torch

    return getattr(torch, definition.inputs[name].dtype)


def _boundary_pairs(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the expert ranked last inside the top ``k`` and the one ranked first outside."""
    import torch

    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[:, k - 1], order[:, k]


def _softmax_router_inputs(definition: Definition, axes: Mapping[str, int],
                           gen: torch.Generator, device: str) -> dict[str, Any]:
    import torch

    consts = definition.const_axes
    n, e, k = axes["num_tokens"], consts["num_experts"], consts["top_k"]
    dtype = _dtype(definition, "router_logits")
    logits = (torch.randn(n, e, generator=gen, device=device) * 2.0).to(dtype)
    if k < e:
        inside, outside = _boundary_pairs(logits.float(), k)
        rows = torch.arange(n, device=device)
        exact, near = rows[1::4], rows[2::4]
        # Exact ties at the top-k boundary (the lower expert id wins) and near-ties one
        # representable step apart: the cases where a router's tie rule shows.
        logits[exact, outside[exact]] = logits[exact, inside[exact]]
        below = torch.full((len(near),), float("-inf"), dtype=dtype, device=device)
        logits[near, outside[near]] = torch.nextafter(logits[near, inside[near]], below)
    return {"router_logits": logits}


def _grouped_router_inputs(definition: Definition, axes: Mapping[str, int],
                           gen: torch.Generator, device: str) -> dict[str, Any]:
    import torch

    consts = definition.const_axes
    n, e, k = axes["num_tokens"], consts["num_experts"], consts["top_k"]
    dtype = _dtype(definition, "router_logits")
    logits = torch.randn(n, e, generator=gen, device=device, dtype=torch.float64) * 1.5
    # Experts 2j and 2j+1 share a bias, so that equal logits tie exactly (see below).
    bias = (torch.rand((e + 1) // 2, generator=gen, device=device, dtype=torch.float64) - 0.5)
    bias = bias.repeat_interleave(2)[:e] * 0.2
    if k < e:
        # Every third row: the first expert outside the (ungrouped) top-k gets a biased
        # score 1e-4 below the last one inside, through its logit.
        biased = torch.sigmoid(logits) + bias
        inside, outside = _boundary_pairs(biased, k)
        rows = torch.arange(1, n, 3, device=device)
        target = biased[rows, inside[rows]] - 1e-4 - bias[outside[rows]]
        ok = (target > 1e-3) & (target < 1 - 1e-3)
        rows, target = rows[ok], target[ok]
        logits[rows, outside[rows]] = torch.log(target / (1 - target))
        # Every third row from the third: the k-th expert's partner gets its logit, an exact
        # tie of biased scores (the lower expert id wins; groups tie the same way).
        rows = torch.arange(2, max(n, 2), 3, device=device)
        partner = torch.minimum(inside[rows] ^ 1, torch.tensor(e - 1, device=device))
        logits[rows, partner] = logits[rows, inside[rows]]
    return {"router_logits": logits.to(dtype), "e_score_correction_bias": bias.float()}


def _experts_inputs(definition: Definition, axes: Mapping[str, int],
                    gen: torch.Generator, device: str) -> dict[str, Any]:
    import torch

    c = definition.const_axes
    n, e, h, k = axes["num_tokens"], c["num_experts"], c["hidden_size"], c["top_k"]
    i = c["intermediate_size"]

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(torch.bfloat16)

    # Distinct experts per token, as every router produces.
    ids = torch.rand(n, e, generator=gen, device=device).argsort(dim=-1)[:, :k]
    weights = torch.rand(n, k, generator=gen, device=device) + 0.05
    return {
        "hidden_states": randn(n, h),
        "w13": randn(e, c["gemm1_out_size"], h, scale=h ** -0.5),
        "w2": randn(e, h, i, scale=i ** -0.5),
        "topk_weights": weights / weights.sum(dim=-1, keepdim=True),
        "topk_ids": ids.to(torch.int32),
    }


ROUTER_OUTPUTS = {
    "topk_weights": Tensor(("num_tokens", "top_k"), "float32",
                           "Routing weight of each chosen expert (canonical order)."),
    "topk_ids": Tensor(("num_tokens", "top_k"), "int32", "Chosen expert ids (canonical order)."),
}

def _token_axes(consts: Mapping[str, int], index: int) -> dict[str, int]:
    return {"num_tokens": (16, 1, 7, 33)[index % 4]}


TOPK_SOFTMAX = Template(
    family="moe_topk_softmax",
    op_type="moe_router",
    name=("moe_topk_softmax_e{num_experts}_topk{top_k}_norm{renormalize:d}_{logits_dtype}"
          "_round_{rounding}"),
    description=(
        "Softmax top-k MoE router (Mixtral, Qwen2/3-MoE, Qwen3-Next): probabilities = "
        "softmax(router_logits) in float32; the top_k experts by logit are chosen; with "
        "renormalize (Qwen3's norm_topk_prob) their probabilities are divided by their sum. "
        "topk_weights is a float32 tensor; where its values are rounded to the logits dtype "
        "is the name's last part (rounding): 'none': never (float32 weights); 'output': the "
        "float32 weights rounded once to the logits dtype (transformers `*TopKRouter`, which "
        "returns them in the logits dtype); 'each_op': every op in the logits dtype, as "
        "vLLM CPU `_softmax_topk` computes: with renormalize, softmax of the chosen logits "
        "(float32 inside, rounded once), else z = m + log(sum(exp(router_logits - m))) with "
        "m the row max, then exp(chosen - z), every op's result rounded to the logits dtype "
        "(the sum accumulated in float32). The canonical order (below) is taken "
        "on the rounded weights, so ties the rounding creates are listed by ascending id. "
        + ROUTER_ORDER + " Engine mapping: vLLM CPU `CPURouter.select_experts` (EPLB off; math "
        "in `_softmax_topk`): rounding 'each_op'; transformers `Qwen3MoeTopKRouter` / "
        "`Qwen3NextTopKRouter`: rounding 'output'. Capture stores every row in canonical "
        "order."),
    axes={"num_tokens": var("Tokens routed in this call."),
          "num_experts": const("Routed experts (global)."),
          "top_k": const("Experts chosen per token.")},
    inputs={"router_logits": Tensor(("num_tokens", "num_experts"), "{logits_dtype}",
                                    "Gate logits, one per expert.")},
    outputs=ROUTER_OUTPUTS,
    reference="moe_topk_softmax.py",
    generate=_softmax_router_inputs,
    # Across rounding schemes weights differ: vLLM CPU's exp(logit - logsumexp) in bf16
    # ('each_op' without renormalize) is up to ~3% from the float32 value ('none'), so a
    # kernel of another scheme still passes; the captured bytes are the declared scheme's.
    compare={"topk_ids": CompareRule(kind="selection", scores="router_logits"),
             "topk_weights": CompareRule(atol=1e-5, rtol=4e-2, paired_with="topk_ids")},
    params={"renormalize": True, "logits_dtype": "bfloat16", "rounding": "none"},
    choices={"logits_dtype": ("bfloat16", "float16", "float32"),
             "rounding": ROUTER_ROUNDING},
    constraints=("top_k <= num_experts",),
    tags=("stage:moe_router",),
    engines=("vllm", "transformers"),
    example={"num_experts": 8, "top_k": 2},
    example_axes={"num_tokens": 16},
    workload_axes=_token_axes,
)

TOPK_GROUPED_SIGMOID = Template(
    family="moe_topk_grouped_sigmoid",
    op_type="moe_router",
    name=("moe_topk_grouped_sigmoid_e{num_experts}_topk{top_k}_ng{n_group}_kg{topk_group}"
          "_norm{renormalize:d}_rs{routed_scaling_factor:g}_{logits_dtype}"),
    description=(
        "DeepSeek-V3 'noaux_tc' grouped router (also GLM-4-MoE, DeepSeek-V3.2): scores = "
        "sigmoid(router_logits) in float32; selection uses scores + e_score_correction_bias: "
        "a group's score is the sum of its two best biased scores, the topk_group best groups "
        "are kept, and the top_k best biased experts inside them are chosen. Weights are the "
        "unbiased scores of the chosen experts, divided by their sum if renormalize, then "
        "multiplied by routed_scaling_factor. Group ties also go to the lower group id. "
        + ROUTER_ORDER + " Engine mapping: transformers `DeepseekV3TopkRouter` applies the "
        "model's routed_scaling_factor in the router (instantiate with it). vLLM CPU "
        "`CPURouter.select_experts` (EPLB off; math in `_grouped_topk`) gets routed_scaling_factor=1.0 "
        "for DeepSeek-V3 (apply_routed_scale_to_output: the MoE runner scales the combined "
        "output instead), so its outputs match routed_scaling_factor=1.0; read the router's "
        "own `routed_scaling_factor` when instantiating."),
    axes={"num_tokens": var("Tokens routed in this call."),
          "num_experts": const("Routed experts (global)."),
          "top_k": const("Experts chosen per token."),
          "n_group": const("Expert groups; experts are split into equal consecutive groups."),
          "topk_group": const("Groups kept per token.")},
    inputs={"router_logits": Tensor(("num_tokens", "num_experts"), "{logits_dtype}",
                                    "Gate logits, one per expert."),
            "e_score_correction_bias": Tensor(("num_experts",), "float32",
                                              "Per-expert bias added for selection only.")},
    outputs=ROUTER_OUTPUTS,
    reference="moe_topk_grouped_sigmoid.py",
    generate=_grouped_router_inputs,
    # The selection score (sigmoid + bias) is not an input, so ids must match as sets.
    compare={"topk_ids": CompareRule(kind="selection"),
             "topk_weights": CompareRule(atol=1e-6, rtol=1e-5, paired_with="topk_ids")},
    params={"renormalize": True, "routed_scaling_factor": 1.0, "logits_dtype": "float32"},
    choices={"logits_dtype": ("bfloat16", "float16", "float32")},
    constraints=("num_experts % n_group == 0", "num_experts // n_group >= 2",
                 "topk_group <= n_group", "top_k <= topk_group * (num_experts // n_group)"),
    tags=("stage:moe_router",),
    engines=("vllm", "transformers"),
    # Four experts per group (with two, "sum of the two best" is the group's sum) and a
    # routed scaling factor that shows where it is applied.
    example={"num_experts": 16, "top_k": 3, "n_group": 4, "topk_group": 2,
             "routed_scaling_factor": 2.5},
    example_axes={"num_tokens": 16},
    workload_axes=_token_axes,
)

EXPERTS_SWIGLU = Template(
    family="moe_experts_swiglu",
    op_type="moe",
    name=("moe_experts_swiglu_e{num_experts}_h{hidden_size}_i{intermediate_size}_topk{top_k}"
          "_round_{rounding}"),
    description=(
        "Routed SwiGLU experts (no shared expert): for each token and each of its top_k "
        "(expert id, weight) pairs, gate_up = x @ w13[e].T with gate = the first "
        "intermediate_size rows of w13[e] and up = the rest (vLLM's and transformers' "
        "[gate | up] layout), act = silu(gate) * up, y = act @ w2[e].T, and the output is "
        "the sum of weight * y over the token's pairs. Ids must be in [0, num_experts). "
        "Where it rounds to bf16 is the name's last part (rounding); every scheme rounds "
        "act to bf16 before the down projection and casts the output to bf16 at the end. "
        "'act': nothing else is rounded (float32 gate_up, y, weight * y and sum; vLLM CPU "
        "`cpu_fused_moe`). 'each_op': gate_up, silu(gate), act, y and weight * y are each "
        "rounded to bf16, then summed over the token's pairs in float32 (transformers' "
        "default grouped_mm / batched_mm experts with bf16 routing weights: Qwen3-MoE, "
        "Qwen3-Next). 'each_op_f32_weighting': as 'each_op' but weight * y stays float32 "
        "(the same transformers experts with float32 routing weights: DeepSeek-V3, "
        "GLM-4-MoE). 'each_op_bf16_sum': as 'each_op', but the output starts at 0 and adds "
        "each pair's rounded weight * y in ascending expert id, rounding to bf16 after every "
        "add (transformers experts_implementation='eager'). weight is the float32 input; "
        "products of bf16 values are exact in float32. Float32 sums (dot products, the sum "
        "over pairs) run in the kernel's own order, which flips a rounding on rare "
        "elements (1 ulp). Engine mapping: vLLM CPU `cpu_fused_moe(out, input, "
        "w13, w2, w13_bias=None, w2_bias=None, topk_weights, topk_ids, act='silu', isa, "
        "skip_weighted=False)` with `out` read after the call; its w13/w2 arrive prepacked "
        "by `cpu_prepack_moe_weight` (and the intermediate size zero-padded to a multiple "
        "of 32), so capture must record the unpacked [E, 2I, H] / [E, H, I] weights; "
        "rounding 'act'. Its build for AVX512-BF16 CPUs rounds to nearest even as this "
        "reference does; its AVX-512F and AVX2 builds convert float32 to bf16 by truncation "
        "(act and the output, up to 1 ulp towards zero each), within the compare rule. "
        "transformers `*Experts.forward(hidden_states, top_k_index, top_k_weights)` with "
        "w13 = gate_up_proj, w2 = down_proj; its rounding follows the model's "
        "experts_implementation and routing-weight dtype (above)."),
    axes={"num_tokens": var("Tokens in this call."),
          "num_experts": const("Experts held by this rank."),
          "hidden_size": const("Model hidden size."),
          "intermediate_size": const("Per-expert intermediate size (per TP rank)."),
          "gemm1_out_size": const("Rows of w13: 2 * intermediate_size."),
          "top_k": const("Experts per token.")},
    inputs={
        "hidden_states": Tensor(("num_tokens", "hidden_size"), "bfloat16", "Expert input."),
        "w13": Tensor(("num_experts", "gemm1_out_size", "hidden_size"), "bfloat16",
                      "Fused gate and up projections, gate first."),
        "w2": Tensor(("num_experts", "hidden_size", "intermediate_size"), "bfloat16",
                     "Down projections."),
        "topk_weights": Tensor(("num_tokens", "top_k"), "float32", "Routing weights."),
        "topk_ids": Tensor(("num_tokens", "top_k"), "int32", "Expert ids per token."),
    },
    outputs={"output": Tensor(("num_tokens", "hidden_size"), "bfloat16",
                              "Weighted sum of the chosen experts' outputs.")},
    reference="moe_experts_swiglu.py",
    generate=_experts_inputs,
    compare={"output": CompareRule(atol=1e-2, rtol=2e-2)},
    params={"rounding": "act"},
    choices={"rounding": EXPERT_ROUNDING},
    constraints=("top_k <= num_experts", "gemm1_out_size == 2 * intermediate_size"),
    tags=("stage:moe_experts",),
    engines=("vllm", "transformers"),
    example={"num_experts": 8, "hidden_size": 128, "intermediate_size": 64,
             "gemm1_out_size": 128, "top_k": 2},
    example_axes={"num_tokens": 16},
    workload_axes=_token_axes,
)
