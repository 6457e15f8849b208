"""MoE families: references against plain loops, vLLM CPU's own routing and experts, and
transformers' routers and experts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from enginetap.definitions import compile_reference, get_template, known_template


def reference(family: str, **values):
    defn = get_template(family).instantiate(**values)
    return defn, compile_reference(defn.reference, defn.name)


def canonical(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent canonical order: per row, Python-sort pairs by (-weight, id)."""
    rows = [sorted(zip(w.tolist(), i.tolist()), key=lambda p: (-p[0], p[1]))
            for w, i in zip(weights.float(), ids.long())]
    return (torch.tensor([[w for w, _ in r] for r in rows], dtype=torch.float64),
            torch.tensor([[i for _, i in r] for r in rows], dtype=torch.int64))


def assert_same_routing(ids, weights, ref_ids, ref_weights, *, scores=None, rtol=1e-5):
    """Ids equal as sets per row (a different id is accepted only on an exact score tie);
    weights equal once both rows are in canonical order."""
    for row, (got, want) in enumerate(zip(ids.long().tolist(), ref_ids.long().tolist())):
        extra, missing = sorted(set(got) - set(want)), sorted(set(want) - set(got))
        if scores is not None:
            values = scores[row]
            extra_vals = sorted(values[extra].tolist())
            missing_vals = sorted(values[missing].tolist())
            assert extra_vals == missing_vals, f"row {row}: {got} vs {want}"
        else:
            assert not extra and not missing, f"row {row}: {got} vs {want}"
    got_w, _ = canonical(weights, ids)
    want_w, _ = canonical(ref_weights, ref_ids)
    torch.testing.assert_close(got_w, want_w, rtol=rtol, atol=1e-6)


# --- every family -----------------------------------------------------------------------


def test_params_change_name_and_stay_known():
    template = get_template("moe_topk_grouped_sigmoid")
    defn = template.instantiate(num_experts=16, top_k=4, n_group=4, topk_group=2,
                                renormalize=False, routed_scaling_factor=2.5,
                                logits_dtype="bfloat16")
    assert defn.name == "moe_topk_grouped_sigmoid_e16_topk4_ng4_kg2_norm0_rs2.5_bfloat16"
    assert defn.inputs["router_logits"].dtype == "bfloat16"
    assert known_template(defn) is template
    assert "routed_scaling_factor = 2.5" in defn.reference


# --- softmax router ---------------------------------------------------------------------


def softmax_topk_loop(logits: torch.Tensor, top_k: int, renormalize: bool):
    """Float64, one row at a time: sort (−logit, id), softmax, optional renormalization."""
    weights, ids = [], []
    for row in logits.double():
        probs = torch.exp(row - row.max())
        probs = probs / probs.sum()
        chosen = sorted(range(len(row)), key=lambda e: (-row[e].item(), e))[:top_k]
        w = probs[chosen]
        weights.append(w / w.sum() if renormalize else w)
        ids.append(chosen)
    return torch.stack(weights), torch.tensor(ids)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_softmax_router_matches_float64_loop(renormalize, dtype):
    template = get_template("moe_topk_softmax")
    defn, run = reference("moe_topk_softmax", num_experts=16, top_k=4,
                          renormalize=renormalize, logits_dtype=dtype)
    logits = template.synthetic_inputs(defn, {"num_tokens": 40}, seed=1)["router_logits"]
    weights, ids = run(logits)
    want_w, want_ids = softmax_topk_loop(logits, 4, renormalize)
    # The generator planted exact ties at the top-k boundary: the lower id must win.
    assert torch.equal(canonical(want_w, want_ids)[1], ids.long())
    torch.testing.assert_close(weights.double(), canonical(want_w, want_ids)[0],
                               rtol=1e-5, atol=1e-7)


def test_softmax_router_tie_order_is_canonical():
    _, run = reference("moe_topk_softmax", num_experts=6, top_k=3, logits_dtype="float32")
    logits = torch.tensor([[0.5, 2.0, 1.0, 2.0, 1.0, 1.0],
                           [3.0, 3.0, 3.0, 3.0, 3.0, 3.0]])
    weights, ids = run(logits)
    # Row 0: experts 1 and 3 tie for first, 2/4/5 tie for third: lower ids win, equal
    # weights are listed by ascending id.
    assert ids.tolist() == [[1, 3, 2], [0, 1, 2]]
    assert weights[0, 0] == weights[0, 1] > weights[0, 2]
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(2))


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_router_matches_vllm_cpu(renormalize):
    cpu_router = pytest.importorskip("vllm.model_executor.layers.fused_moe.router.cpu_router")
    template = get_template("moe_topk_softmax")
    # bf16 logits: vLLM computes in bf16, so agreement is only to the family's own rule.
    for dtype, rtol in (("float32", 1e-5), ("bfloat16", template.rule("topk_weights").rtol)):
        defn, run = reference("moe_topk_softmax", num_experts=32, top_k=8,
                              renormalize=renormalize, logits_dtype=dtype)
        logits = template.synthetic_inputs(defn, {"num_tokens": 64}, seed=2)["router_logits"]
        weights, ids = run(logits)
        v_weights, v_ids = cpu_router._softmax_topk(logits, 8, renormalize)
        assert v_weights.dtype == torch.float32 and v_ids.dtype == torch.int32
        assert_same_routing(v_ids, v_weights, ids, weights, scores=logits.float(), rtol=rtol)


# --- grouped sigmoid router -------------------------------------------------------------


def grouped_loop(logits, bias, top_k, n_group, topk_group, renormalize, scale):
    """One token at a time, groups as Python lists, float64."""
    weights, ids = [], []
    per_group = logits.shape[1] // n_group
    for row in logits.double():
        score = torch.sigmoid(row).tolist()
        biased = [s + b for s, b in zip(score, bias.double().tolist())]
        groups = []
        for g in range(n_group):
            members = sorted(biased[g * per_group:(g + 1) * per_group], reverse=True)
            groups.append((-(members[0] + members[1]), g))
        kept = [g for _, g in sorted(groups)[:topk_group]]
        pool = [e for g in kept for e in range(g * per_group, (g + 1) * per_group)]
        chosen = sorted(pool, key=lambda e: (-biased[e], e))[:top_k]
        w = [score[e] for e in chosen]
        total = sum(w) if renormalize else 1.0
        weights.append([x / total * scale for x in w])
        ids.append(chosen)
    return torch.tensor(weights, dtype=torch.float64), torch.tensor(ids)


GROUPED = {"num_experts": 16, "top_k": 4, "n_group": 4, "topk_group": 2}


@pytest.mark.parametrize(("renormalize", "scale"), [(True, 2.5), (False, 1.0)])
def test_grouped_router_matches_plain_loop(renormalize, scale):
    template = get_template("moe_topk_grouped_sigmoid")
    defn, run = reference("moe_topk_grouped_sigmoid", **GROUPED, renormalize=renormalize,
                          routed_scaling_factor=scale)
    inputs = template.synthetic_inputs(defn, {"num_tokens": 48}, seed=4)
    weights, ids = run(**inputs)
    want_w, want_ids = grouped_loop(inputs["router_logits"], inputs["e_score_correction_bias"],
                                    4, 4, 2, renormalize, scale)
    want_w, want_ids = canonical(want_w, want_ids)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights.double(), want_w, rtol=1e-5, atol=1e-7)


def test_grouped_router_tie_order_is_canonical():
    _, run = reference("moe_topk_grouped_sigmoid", num_experts=8, top_k=2, n_group=4,
                       topk_group=2)
    # Equal logits and equal biases: all four groups tie, so groups 0 and 1 are kept, and
    # within them experts 0 and 1 win the expert tie.
    weights, ids = run(torch.full((1, 8), 0.3), torch.full((8,), 0.1))
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(weights, torch.tensor([[0.5, 0.5]]))
    # The bias steers selection but not weights: expert 5 is picked through its bias,
    # yet weighs less than expert 4 (larger logit), which is listed first.
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 2.0, 1.0, 0.0, 0.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0, 0.0])
    weights, ids = run(logits, bias)
    assert ids.tolist() == [[4, 5]]
    assert weights[0, 0] > weights[0, 1]


@pytest.mark.parametrize(("renormalize", "scale"), [(True, 1.0), (False, 2.5)])
def test_grouped_router_matches_vllm_cpu(renormalize, scale):
    cpu_router = pytest.importorskip("vllm.model_executor.layers.fused_moe.router.cpu_router")
    template = get_template("moe_topk_grouped_sigmoid")
    for dtype in ("float32", "bfloat16"):
        defn, run = reference("moe_topk_grouped_sigmoid", **GROUPED, renormalize=renormalize,
                              routed_scaling_factor=scale, logits_dtype=dtype)
        inputs = template.synthetic_inputs(defn, {"num_tokens": 64}, seed=7)
        weights, ids = run(**inputs)
        v_weights, v_ids = cpu_router._grouped_topk(
            inputs["router_logits"], 4, renormalize, 4, 2, "sigmoid", scale,
            inputs["e_score_correction_bias"])
        # Exact ties (by construction) may go either way in vLLM's torch.topk.
        biased = torch.sigmoid(inputs["router_logits"].float()) + inputs["e_score_correction_bias"]
        assert_same_routing(v_ids, v_weights, ids, weights, scores=biased)


def test_grouped_router_matches_transformers_deepseek_v3():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=64, n_routed_experts=16, num_experts_per_tok=4,
                              n_group=4, topk_group=2, norm_topk_prob=True,
                              routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(config)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 64, generator=gen) * 0.3)
        router.e_score_correction_bias.copy_((torch.rand(16, generator=gen) - 0.5) * 0.2)
        logits, t_weights, t_ids = router(torch.randn(48, 64, generator=gen))
    _, run = reference("moe_topk_grouped_sigmoid", **GROUPED, routed_scaling_factor=2.5)
    weights, ids = run(logits, router.e_score_correction_bias)
    assert_same_routing(t_ids, t_weights, ids, weights)


# --- experts ----------------------------------------------------------------------------

EXPERTS = {"num_experts": 8, "hidden_size": 128, "intermediate_size": 64,
           "gemm1_out_size": 128, "top_k": 3}


def experts_loop(hidden, w13, w2, weights, ids, inter):
    """Per token, per chosen expert, with separate gate and up matrices, float64."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        x = hidden[t].double()
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate_w, up_w, down_w = w13[e, :inter].double(), w13[e, inter:].double(), w2[e].double()
            act = (F.silu(gate_w @ x) * (up_w @ x)).to(torch.bfloat16).double()
            out[t] += weights[t, k].double() * (down_w @ act)
    return out


def experts_case(seed: int, num_tokens: int = 20):
    template = get_template("moe_experts_swiglu")
    defn, run = reference("moe_experts_swiglu", **EXPERTS)
    return run, template.synthetic_inputs(defn, {"num_tokens": num_tokens}, seed=seed)


def test_experts_match_per_token_loop():
    run, inputs = experts_case(seed=8)
    got = run(**inputs)
    x, w13, w2 = inputs["hidden_states"], inputs["w13"], inputs["w2"]
    routing = inputs["topk_weights"], inputs["topk_ids"]
    want = experts_loop(x, w13, w2, *routing, EXPERTS["intermediate_size"])
    torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=1e-2)
    # Swapping gate and up must be caught at this tolerance.
    swapped = torch.cat([w13[:, 64:], w13[:, :64]], dim=1)
    wrong = experts_loop(x, swapped, w2, *routing, EXPERTS["intermediate_size"])
    assert not torch.allclose(got.double(), wrong, atol=1e-2, rtol=1e-2)


def test_experts_match_vllm_cpu_fused_moe():
    ops = pytest.importorskip("vllm._custom_ops")
    if not hasattr(torch.ops._C, "cpu_fused_moe"):
        pytest.skip("this vLLM build has no CPU fused-MoE kernel")
    run, inputs = experts_case(seed=9, num_tokens=33)
    got = run(**inputs)
    out = torch.empty_like(inputs["hidden_states"])
    # "vec" is the portable kernel; vLLM prepacks the weights for it before any call.
    ops.cpu_fused_moe(out, inputs["hidden_states"],
                      ops.cpu_prepack_moe_weight(inputs["w13"], "vec"),
                      ops.cpu_prepack_moe_weight(inputs["w2"], "vec"), None, None,
                      inputs["topk_weights"], inputs["topk_ids"], "silu", "vec")
    torch.testing.assert_close(out.float(), got.float(), atol=1e-2, rtol=2e-2)


def test_experts_match_transformers_experts():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    run, inputs = experts_case(seed=10)
    config = DeepseekV3Config(hidden_size=128, moe_intermediate_size=64, n_routed_experts=8,
                              hidden_act="silu")
    experts = DeepseekV3Experts(config).to(torch.bfloat16)
    with torch.no_grad():
        experts.gate_up_proj.copy_(inputs["w13"])
        experts.down_proj.copy_(inputs["w2"])
        theirs = experts(inputs["hidden_states"], inputs["topk_ids"].long(),
                         inputs["topk_weights"])
    # transformers rounds to bf16 after every op, so agreement is to a few bf16 steps.
    torch.testing.assert_close(theirs.float(), run(**inputs).float(), atol=3e-2, rtol=3e-2)


# --- DeepSeek-V4 routers (sqrt(softplus) scores) -----------------------------------------

def _v4_router():
    cpu_router = pytest.importorskip("vllm.model_executor.layers.fused_moe.router.cpu_router")
    if not hasattr(torch.ops._C, "biased_topk_cpu"):
        # The SGLang-derived kernels behind it exist only in vLLM's AVX-512 builds.
        pytest.skip("this vLLM CPU build has no biased_topk_cpu (AVX2 path)")
    return cpu_router._sqrtsoftplus_bias_topk


def test_sqrtsoftplus_router_by_its_formula_and_tie_order():
    defn, run = reference("moe_topk_sqrtsoftplus", num_experts=8, top_k=2,
                          routed_scaling_factor=2.0)
    logits = torch.tensor([[0.5, 0.5, -1.0, 2.0, 0.0, -3.0, 1.0, 0.25]])
    bias = torch.tensor([0.0, 0.0, 0.5, -0.5, 0.1, 0.0, -0.2, 0.0])
    weights, ids = run(logits, bias)
    score = F.softplus(logits.double()).sqrt()
    biased = (score + bias.double())[0].tolist()
    # Experts 0 and 1 tie for second place on the biased score; the lower id is kept.
    assert biased[0] == biased[1]
    order = sorted(range(8), key=lambda e: (-biased[e], e))[:2]
    assert order == [2, 0]
    want = score[0, order] / score[0, order].sum() * 2.0
    want_w, want_ids = canonical(want[None], torch.tensor([order]))
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights.double(), want_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_sqrtsoftplus_router_matches_vllm_cpu(scale):
    router = _v4_router()
    defn, run = reference("moe_topk_sqrtsoftplus", num_experts=256, top_k=8,
                          routed_scaling_factor=scale)
    template = get_template("moe_topk_sqrtsoftplus")
    for index in range(3):
        axes = template.axes_for(defn.const_axes, index)
        inputs = template.synthetic_inputs(defn, axes, seed=40 + index)
        weights, ids = run(**inputs)
        theirs_w, theirs_ids = router(inputs["router_logits"], 8, True,
                                      inputs["e_score_correction_bias"], scale, None, None)
        biased = F.softplus(inputs["router_logits"].float()).sqrt() + \
            inputs["e_score_correction_bias"]
        assert_same_routing(theirs_ids, theirs_w, ids, weights, scores=biased)


def test_hash_router_matches_vllm_cpu():
    router = _v4_router()
    defn, run = reference("moe_topk_sqrtsoftplus_hash", num_experts=256, top_k=8,
                          routed_scaling_factor=1.5)
    gen = torch.Generator().manual_seed(7)
    table = torch.rand(100, 256, generator=gen).argsort(dim=-1)[:, :8].to(torch.int32)
    input_ids = torch.randint(0, 100, (12,), generator=gen)
    logits = torch.randn(12, 256, generator=gen) * 2
    weights, ids = run(logits, table[input_ids])
    theirs_w, theirs_ids = router(logits, 8, True, None, 1.5, input_ids, table)
    assert_same_routing(theirs_ids, theirs_w, ids, weights)
