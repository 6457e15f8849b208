"""Seed-only families: each reference against an independent computation (float64, formats
decoded by their own formulas), plus the template contract: valid definitions that
``known_template`` recognises, outputs as declared, deterministic non-trivial generators."""

from __future__ import annotations

import math

import pytest
import torch

from enginetap.dataset.schema import Definition
from enginetap.definitions import Template, compile_reference, get_template, known_template
from enginetap.definitions.families import SEED_ONLY
from enginetap.errors import DefinitionError

FAMILIES = [t.family for t in SEED_ONLY]
GEMM, MLA_DECODE, MLA_PREFILL, TOPK, GQA = FAMILIES
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8,
          "int32": torch.int32, "float8_e4m3fn": torch.float8_e4m3fn}
# The OCP MX e2m1 table, codes 0..15.
E2M1_GOLDEN = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _case(family: str, seed: int = 0, axes: dict | None = None, **params):
    template = get_template(family)
    definition = template.instantiate(**template.example, **params)
    inputs = template.synthetic_inputs(definition, {**template.example_axes, **(axes or {})}, seed)
    return template, definition, inputs, compile_reference(definition.reference, definition.name)


# ---- independent decoders -----------------------------------------------------------------

def _e2m1(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 by its bit formula: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0."""
    exponent, mantissa = (codes >> 1) & 3, (codes & 1).double()
    magnitude = torch.where(exponent == 0, 0.5 * mantissa,
                            torch.pow(2.0, (exponent - 1).double()) * (1 + 0.5 * mantissa))
    return torch.where(codes & 8 > 0, -magnitude, magnitude)


def _fp4(packed: torch.Tensor) -> torch.Tensor:
    """Packed int8 -> float64, element 2i from the low nibble."""
    byte = packed.view(torch.uint8).long()
    return _e2m1(torch.stack((byte % 16, byte // 16), dim=-1).flatten(-2))


def _e8m0(raw: torch.Tensor) -> torch.Tensor:
    return raw.view(torch.uint8).view(torch.float8_e8m0fnu).double()


def _attention(logits, mask, values, sink=None):
    """float64 softmax attention; the sink is one more logit column whose value is zero."""
    logits = logits.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1) / math.log(2.0)
    if sink is not None:
        logits = torch.cat((logits, sink.expand(*logits.shape[:-1], 1)), dim=-1)
        values = torch.cat((values, values.new_zeros(*values.shape[:-2], 1, values.shape[-1])), -2)
    return torch.softmax(logits, dim=-1) @ values, lse


def _close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> None:
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=atol)


# ---- formats --------------------------------------------------------------------------------

def test_fp8_e4m3fn_codes_round_trip() -> None:
    raw = torch.arange(256, dtype=torch.int16).to(torch.uint8)
    values = raw.view(torch.float8_e4m3fn).double()
    exponent, mantissa = ((raw >> 3) & 15).double(), (raw & 7).double()
    magnitude = torch.where(exponent == 0, mantissa / 8 * 2.0 ** -6,
                            (1 + mantissa / 8) * torch.pow(2.0, exponent - 7))
    expected = torch.where(raw >= 128, -magnitude, magnitude)
    nan = (raw & 0x7F) == 0x7F
    assert torch.isnan(values[nan]).all()
    assert torch.equal(values[~nan], expected[~nan])
    assert float(values[~nan].abs().max()) == 448.0
    assert torch.equal(values[~nan].to(torch.float8_e4m3fn).view(torch.uint8), raw[~nan])


def _unit_gemm(w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The reference applied to identity activations: row r of the output is column r of W."""
    template = get_template(GEMM)
    n = w.shape[1]
    definition = template.instantiate(num_experts=1, n=n, k=32, k_blocks=1, k_packed=16,
                                      k_groups=1)
    run = compile_reference(definition.reference)
    a = torch.eye(32).to(torch.float8_e4m3fn)
    return run(a, torch.ones(32, 1), w, w_scale, torch.tensor([0, 32], dtype=torch.int32)).float()


def test_fp4_nibbles_decode_to_the_e2m1_table_low_nibble_first() -> None:
    codes = torch.arange(16)
    assert torch.equal(_e2m1(codes), torch.tensor(E2M1_GOLDEN, dtype=torch.float64))
    # Weight row c: every byte holds code c in its low nibble and 15 - c in its high one.
    w = (codes + 16 * (15 - codes))[:, None].expand(16, 16).to(torch.uint8).view(torch.int8)
    y = _unit_gemm(w[None].contiguous(), torch.full((1, 16, 1), 127, dtype=torch.int8))
    golden = torch.tensor(E2M1_GOLDEN)
    assert torch.equal(y[0::2], golden.expand(16, 16))
    assert torch.equal(y[1::2], golden.flip(0).expand(16, 16))


def test_e8m0_scale_bytes_are_unsigned_powers_of_two() -> None:
    scale = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.int8)
    w = torch.full((1, 256, 16), 0x22, dtype=torch.int8)  # e2m1 code 2 = 1.0, twice
    y = _unit_gemm(w, scale.reshape(1, 256, 1))
    expected = _e8m0(scale).float().to(torch.bfloat16).float()
    torch.testing.assert_close(y, expected.expand(32, 256), rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(y[:, 255]).all() and float(y[0, 128]) == 2.0


# ---- grouped GEMM ---------------------------------------------------------------------------

def _gemm_by_groups(a, a_scale, w, w_scale, m_indptr) -> torch.Tensor:
    """Accumulate over k in groups of 32 on raw codes, applying both scales per group."""
    k = a.shape[1]
    block = k // a_scale.shape[1]
    bounds = m_indptr.tolist()
    out = torch.zeros(a.shape[0], w.shape[1], dtype=torch.float64)
    for expert, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        codes, scales = _fp4(w[expert]), _e8m0(w_scale[expert])
        for group in range(k // 32):
            cols = slice(32 * group, 32 * group + 32)
            partial = a[lo:hi, cols].double() @ codes[:, cols].T
            a_group = a_scale[lo:hi, 32 * group // block, None].double()
            out[lo:hi] += partial * a_group * scales[None, :, group]
    return out


@pytest.mark.parametrize("k_blocks", [2, 1])
@pytest.mark.parametrize("seed", [0, 1])
def test_grouped_gemm_matches_per_group_accumulation(k_blocks: int, seed: int) -> None:
    template = get_template(GEMM)
    definition = template.instantiate(**{**template.example, "k_blocks": k_blocks})
    inputs = template.synthetic_inputs(definition, template.example_axes, seed)
    y = compile_reference(definition.reference)(**inputs)
    expected = _gemm_by_groups(**inputs)
    assert expected.abs().max() > 0
    _close(y, expected, rtol=8e-3, atol=1e-3 * float(expected.abs().max()))


def test_grouped_gemm_refuses_offsets_that_do_not_cover_the_rows() -> None:
    _, _, inputs, run = _case(GEMM)
    inputs["m_indptr"] = inputs["m_indptr"].clone()
    inputs["m_indptr"][-1] -= 1
    with pytest.raises(ValueError, match="m_indptr"):
        run(**inputs)


# ---- MLA decode over FP8 + FP4 caches -------------------------------------------------------

def _dense_mla_decode(inp: dict, c: dict):
    """Dequantize both whole caches, attend every slot under a mask built from the indices."""
    tile = c["ckv_dim"] // c["ckv_tiles"]
    latent8 = inp["ckv8_cache"].double() * inp["ckv8_scale"].double().repeat_interleave(tile, -1)
    latent4 = _fp4(inp["ckv4_cache"]) * _e8m0(inp["ckv4_scale"]).repeat_interleave(32, -1)
    latent = torch.cat((latent8.reshape(-1, c["ckv_dim"]), latent4.reshape(-1, c["ckv_dim"])))
    rope = torch.cat((inp["kpe8_cache"].reshape(-1, c["kpe_dim"]),
                      inp["kpe4_cache"].reshape(-1, c["kpe_dim"]))).double()
    slots8 = latent8.shape[0] * latent8.shape[1]
    mask = torch.zeros(inp["q_nope"].shape[0], latent.shape[0], dtype=torch.bool)
    for row, (ids8, ids4) in enumerate(zip(inp["indices8"].tolist(), inp["indices4"].tolist())):
        for slot in ids8:
            mask[row, slot] |= slot >= 0
        for slot in ids4:
            mask[row, slots8 + slot] |= slot >= 0
    logits = (inp["q_nope"].double() @ latent.T + inp["q_pe"].double() @ rope.T) * inp["sm_scale"]
    return _attention(logits, mask[:, None, :], latent, inp["attn_sink"].double()[None, :, None])


@pytest.mark.parametrize("sink", ["random", "disabled"])
@pytest.mark.parametrize("seed", [0, 3])
def test_mla_fp8_fp4_decode_matches_dense_attention_with_sink_column(sink: str, seed: int) -> None:
    _, definition, inputs, run = _case(MLA_DECODE, seed)
    if sink == "disabled":
        inputs["attn_sink"] = torch.full_like(inputs["attn_sink"], float("-inf"))
    output, lse = run(**inputs)
    expected, expected_lse = _dense_mla_decode(inputs, definition.const_axes)
    _close(output, expected, rtol=1e-2, atol=1e-2)
    _close(lse, expected_lse, rtol=1e-5, atol=1e-4)


def test_mla_decode_sink_only_shrinks_the_output() -> None:
    _, _, inputs, run = _case(MLA_DECODE, 5)
    inputs["attn_sink"] = torch.full_like(inputs["attn_sink"], float("-inf"))
    plain, plain_lse = run(**inputs)
    inputs["attn_sink"] = torch.full_like(inputs["attn_sink"], 2.0)
    sunk, sunk_lse = run(**inputs)
    # With the sink, output = plain * L / (L + e^sink), L = sum of exp(logits) = 2 ** lse.
    shrink = 1 / (1 + torch.exp(2.0 - plain_lse * math.log(2.0)))
    _close(sunk, plain.double() * shrink[..., None].double(), rtol=2e-2, atol=2e-2)
    assert torch.equal(sunk_lse, plain_lse)


def test_mla_decode_row_without_slots_gives_zero_and_minus_infinity() -> None:
    _, _, inputs, run = _case(MLA_DECODE, 2)
    for name in ("indices8", "indices4"):
        inputs[name] = inputs[name].clone()
        inputs[name][1] = -1
    output, lse = run(**inputs)
    assert (output[1] == 0).all() and torch.isneginf(lse[1]).all()
    assert torch.isfinite(lse[0]).all() and output[0].abs().max() > 0


# ---- sparse MLA prefill ---------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 4])
def test_sparse_mla_prefill_matches_dense_masked_attention(seed: int) -> None:
    _, _, inputs, run = _case(MLA_PREFILL, seed)
    output, lse = run(**inputs)
    latent = inputs["ckv_cache"].double().flatten(0, 1)
    rope = inputs["kpe_cache"].double().flatten(0, 1)
    mask = torch.zeros(inputs["q_nope"].shape[0], latent.shape[0], dtype=torch.bool)
    for token, (ids, length) in enumerate(zip(inputs["sparse_indices"].tolist(),
                                              inputs["topk_lens"].tolist())):
        for slot in ids[:length]:
            mask[token, slot] |= slot >= 0
    logits = (inputs["q_nope"].double() @ latent.T
              + inputs["q_pe"].double() @ rope.T) * inputs["sm_scale"]
    expected, expected_lse = _attention(logits, mask[:, None, :], latent,
                                        inputs["attn_sink"].double()[None, :, None])
    _close(output, expected, rtol=1e-2, atol=1e-2)
    _close(lse, expected_lse, rtol=1e-5, atol=1e-4)


# ---- compressed top-k -----------------------------------------------------------------------

def _brute_topk(inp: dict, c: dict, relu: bool):
    """Per token, per visible block: fp64 score; rank by (-score, block id)."""
    chosen, scores = [], []
    for t, length in enumerate(inp["seq_lens"].tolist()):
        row = []
        for block in range(length // c["block_size"]):
            page = int(inp["page_table"][t, block // c["page_size"]])
            dots = inp["q"][t].double() @ inp["kc_cache"][page, block % c["page_size"]].double()
            row.append(float((dots.clamp(min=0) if relu else dots) @ inp["weights"][t].double()))
        scores.append(row)
        chosen.append(sorted(range(len(row)), key=lambda b: (-row[b], b))[:c["topk"]])
    return chosen, scores


def _check_topk(inputs: dict, definition: Definition, relu: bool, exact: bool) -> None:
    c = definition.const_axes
    block_ids, scores = compile_reference(definition.reference)(**inputs)
    chosen, brute = _brute_topk(inputs, c, relu)
    for t, (ids, want, row) in enumerate(zip(block_ids.tolist(), chosen, brute)):
        got = [i for i in ids if i >= 0]
        assert got == sorted(got) and ids[len(got):] == [-1] * (len(ids) - len(got))
        assert len(got) == len(want)
        if exact:
            assert got == sorted(want)
        else:  # fp32 vs fp64 may swap blocks whose scores tie closely
            picked = sorted((row[i] for i in got), reverse=True)
            best = sorted((row[i] for i in want), reverse=True)
            assert picked == pytest.approx(best, rel=1e-5, abs=1e-4)
        flat = scores[t].flatten()
        assert torch.isneginf(flat[len(row):]).all()
        _close(flat[:len(row)], torch.tensor(row, dtype=torch.float64), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("relu", [True, False])
def test_compressed_topk_matches_brute_force(relu: bool) -> None:
    template, definition, inputs, _ = _case(TOPK, 0, relu=relu)
    assert known_template(definition) is template
    _check_topk(inputs, definition, relu, exact=False)


@pytest.mark.parametrize("relu", [True, False])
def test_compressed_topk_ties_go_to_lower_block_ids(relu: bool) -> None:
    # Small integers make every score exact in float32 and float64, so ties are real ties.
    _, definition, inputs, _ = _case(TOPK, 1, relu=relu)
    gen = torch.Generator().manual_seed(7)
    inputs["q"] = torch.randint(-2, 3, inputs["q"].shape, generator=gen).to(torch.bfloat16)
    inputs["kc_cache"] = torch.randint(-1, 2, inputs["kc_cache"].shape,
                                       generator=gen).to(torch.bfloat16)
    inputs["weights"] = torch.randint(-2, 3, inputs["weights"].shape, generator=gen) / 2.0
    _check_topk(inputs, definition, relu, exact=True)
    inputs["kc_cache"] = inputs["kc_cache"][:1, :1].expand_as(inputs["kc_cache"]).contiguous()
    block_ids, _ = compile_reference(definition.reference)(**inputs)
    last = inputs["seq_lens"].shape[0] - 1  # sees every block, all scores equal
    assert block_ids[last].tolist() == list(range(definition.const_axes["topk"]))


# ---- sparse GQA decode ----------------------------------------------------------------------

@pytest.mark.parametrize("sel_heads", [2, 1])
def test_sparse_gqa_decode_matches_dense_attention_under_block_mask(sel_heads: int) -> None:
    _, definition, inputs, run = _case(GQA, 0, {"sel_heads": sel_heads})
    c = definition.const_axes
    output, lse = run(**inputs)
    group = c["num_qo_heads"] // c["num_kv_heads"]
    for s, length in enumerate(inputs["seq_lens"].tolist()):
        tokens = torch.arange(length)
        pages = inputs["page_table"][s, tokens // c["page_size"]].long()
        keys = inputs["k_cache"][pages, tokens % c["page_size"]].double()  # [L, kv, D]
        values = inputs["v_cache"][pages, tokens % c["page_size"]].double()
        ids = inputs["block_ids"][s].expand(c["num_kv_heads"], -1)
        mask = torch.stack([torch.isin(tokens // c["block_size"], row[row >= 0]) for row in ids])
        q = inputs["q"][s].double().reshape(c["num_kv_heads"], group, -1)
        logits = torch.einsum("gqd,lgd->gql", q, keys) * inputs["sm_scale"]
        expected, expected_lse = _attention(logits, mask[:, None, :], values.transpose(0, 1))
        _close(output[s], expected.reshape(c["num_qo_heads"], -1), rtol=1e-2, atol=1e-2)
        _close(lse[s], expected_lse.reshape(-1), rtol=1e-5, atol=1e-4)


def test_sparse_gqa_generator_refuses_a_selection_width_that_is_no_head_count() -> None:
    template = get_template(GQA)
    with pytest.raises(DefinitionError, match="sel_heads"):
        template.synthetic_inputs(template.example_definition(),
                                  {**template.example_axes, "sel_heads": 3})


# ---- the template contract ------------------------------------------------------------------

def _same(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.float8_e4m3fn:  # compare the bytes
            x, y = x.view(torch.int8), y.view(torch.int8)
        return torch.equal(x, y)
    return x == y


@pytest.mark.parametrize("family", FAMILIES)
def test_example_is_a_valid_known_definition(family: str) -> None:
    template = get_template(family)
    definition = template.example_definition()
    assert isinstance(template, Template) and template.engines == ()
    assert Definition.model_validate_json(definition.model_dump_json()) == definition
    assert known_template(definition) is template
    tampered = definition.model_copy(update={"reference": definition.reference + "\n# edited\n"})
    assert known_template(tampered) is None
    fib = pytest.importorskip("flashinfer_bench.data")
    assert fib.Definition.model_validate_json(definition.model_dump_json()).name == definition.name


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_runs_on_synthetic_inputs_with_declared_outputs(family: str) -> None:
    template, definition, inputs, run = _case(family)
    axes = template.example_axes
    assert list(inputs) == list(definition.inputs)
    for name, spec in definition.inputs.items():
        if spec.shape is None:
            assert isinstance(inputs[name], float)
            continue
        assert tuple(inputs[name].shape) == definition.shape_of(spec, dict(axes)), name
        assert inputs[name].dtype == DTYPES[spec.dtype], name
    outputs = run(**inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    assert len(outputs) == len(definition.outputs)
    for value, (name, spec) in zip(outputs, definition.outputs.items()):
        assert tuple(value.shape) == definition.shape_of(spec, dict(axes)), name
        assert value.dtype == DTYPES[spec.dtype], name
        assert not torch.isnan(value.double()).any(), name


@pytest.mark.parametrize("family", FAMILIES)
def test_generator_is_deterministic_and_seed_dependent(family: str) -> None:
    template = get_template(family)
    definition = template.example_definition()
    first, again, other = (template.synthetic_inputs(definition, template.example_axes, seed)
                           for seed in (3, 3, 4))
    assert all(_same(first[k], again[k]) for k in first)
    assert not all(_same(first[k], other[k]) for k in first)
    for name, value in first.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            assert value.double().abs().max() > 0, f"{name} is all zeros"


def _has_padding(ids: torch.Tensor) -> bool:
    return bool((ids == -1).any()) and bool((ids >= 0).any())


# Per family, what its example generator must exercise (block_size is 4 in the examples).
NONTRIVIAL = {
    GEMM: lambda i, o: (bool((i["m_indptr"].diff() == 0).any())
                        and i["a_scale"].unique().numel() == i["a_scale"].numel()
                        and i["w_scale"].unique().numel() > 2 and bool((i["w_scale"] < 0).any())),
    MLA_DECODE: lambda i, o: (_has_padding(i["indices8"]) and _has_padding(i["indices4"])
                              and i["ckv8_scale"].unique().numel() > 1
                              and i["ckv4_scale"].unique().numel() > 2),
    MLA_PREFILL: lambda i, o: (bool((i["topk_lens"] < i["sparse_indices"].shape[1]).any())
                               and bool((i["sparse_indices"] == -1).any())),
    TOPK: lambda i, o: _has_padding(o[0]) and bool((i["page_table"] == -1).any()),
    GQA: lambda i, o: _has_padding(i["block_ids"]) and bool((i["seq_lens"] % 4 > 0).any()),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_generator_exercises_scales_and_padding(family: str) -> None:
    _, _, inputs, run = _case(family, 0)
    assert NONTRIVIAL[family](inputs, run(**inputs))


def test_seed_layout_adapter_gives_the_seed_gemm() -> None:
    """The seed's layout (per-row expert ids, group-32 E8M0 activation scales), computed by
    its own formula in float64, equals this family's reference on the adapted inputs."""
    from enginetap.definitions.seeded_moe import seed_layout_to_indptr

    template = get_template(GEMM)
    definition = template.instantiate(**{**template.example, "k_blocks": 256 // 32})
    gen = torch.Generator().manual_seed(5)
    c = definition.const_axes
    rows, experts = 19, c["num_experts"]
    a = (torch.randn(rows, c["k"], generator=gen) * 4).to(torch.float8_e4m3fn)
    a_e8m0 = torch.randint(122, 131, (rows, c["k"] // 32), generator=gen).to(torch.uint8)
    ids = torch.randint(0, experts, (rows,), generator=gen)
    w = torch.randint(-128, 128, (experts, c["n"], c["k_packed"]), generator=gen).to(torch.int8)
    w_scale = torch.randint(124, 130, (experts, c["n"], c["k_groups"]),
                            generator=gen).to(torch.uint8).view(torch.int8)
    weights = [_e2m1((w[e].view(torch.uint8).long().unsqueeze(-1) >> torch.tensor([0, 4]))
                     & 0xF).flatten(-2)
               * torch.pow(2.0, (w_scale[e].view(torch.uint8).double() - 127)
                           ).repeat_interleave(32, -1) for e in range(experts)]
    x = a.double() * torch.pow(2.0, a_e8m0.double() - 127).repeat_interleave(32, -1)
    seed_out = torch.stack([x[r] @ weights[int(ids[r])].T for r in range(rows)])
    adapted = seed_layout_to_indptr(a, a_e8m0, ids, experts)
    order = adapted.pop("order")
    y = compile_reference(definition.reference)(**adapted, w=w, w_scale=w_scale)
    _close(y, seed_out[order], rtol=8e-3, atol=1e-3 * float(seed_out.abs().max()))


@pytest.mark.parametrize(("family", "name"), [("dsa_sparse_mla", "sparse_indices"),
                                              (MLA_PREFILL, "sparse_indices"),
                                              (MLA_DECODE, "indices8"), (GQA, "block_ids")])
def test_a_slot_listed_twice_is_refused(family: str, name: str) -> None:
    _, _, inputs, run = _case(family)
    inputs[name] = inputs[name].clone()
    row = inputs[name][-1].flatten()
    first_valid = row[row >= 0][0]
    row[-1] = first_valid  # the last entry of a row repeats its first valid one
    inputs[name][-1] = row.view(inputs[name][-1].shape)
    if family == MLA_PREFILL:
        inputs["topk_lens"][-1] = inputs[name].shape[-1]
    with pytest.raises(ValueError, match="twice"):
        run(**inputs)
