"""mla_paged_decode: the absorbed reference against un-absorbed float64 MLA and vLLM's kernel."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from enginetap.definitions import compile_reference, get_template

CONSTS = {"num_qo_heads": 4, "head_dim_ckv": 512, "head_dim_kpe": 64}
AXES = {"batch_size": 4, "len_indptr": 5, "num_pages": 24, "num_kv_indices": 11}

# bf16 outputs of vLLM CPU kernels, on every kernel path (test_cpu_paths.py runs these tests
# on the AVX2 and AVX-512F paths too): AMX and vector kernels sum in float32 in their own
# order, and the AVX2/AVX-512F builds convert to bf16 by truncation (up to 1 ulp, i.e. 2**-7
# of the value, below where the AMX build rounds). 1e-2 absolute covers the summation order
# near zero; 3 * 2**-7 relative covers a truncation on top of our own rounding (2**-8).
ENGINE_ATOL, ENGINE_RTOL = 1e-2, 3 * 2.0 ** -7


def _case(dtype: str, page_size: int, seed: int):
    template = get_template("mla_paged_decode")
    definition = template.instantiate(**CONSTS, page_size=page_size, dtype=dtype)
    inputs = template.synthetic_inputs(definition, AXES, seed=seed)
    return inputs, compile_reference(definition.reference, definition.name)


def _latents(inputs: dict, b: int, page_size: int) -> torch.Tensor:
    """Request b's latent tokens [ckv, kpe], walked one slot at a time through its pages."""
    start, end = inputs["kv_indptr"][b].item(), inputs["kv_indptr"][b + 1].item()
    length = (end - start - 1) * page_size + inputs["kv_last_page_len"][b].item()
    pages = inputs["kv_indices"].tolist()
    rows = []
    for i in range(length):
        page, slot = pages[start + i // page_size], i % page_size
        rows.append(torch.cat([inputs["ckv_cache"][page, slot], inputs["kpe_cache"][page, slot]]))
    return torch.stack(rows)


def test_absorbed_decode_equals_unabsorbed_mla() -> None:
    """Per-head keys W_UK ckv and values W_UV ckv, in float64, give the same attention."""
    inputs, run = _case("float32", 16, seed=21)
    gen = torch.Generator().manual_seed(5)
    heads, nope, v_dim, ckv_dim = 4, 32, 32, CONSTS["head_dim_ckv"]
    w_uk = torch.randn(heads, nope, ckv_dim, generator=gen, dtype=torch.float64) / math.sqrt(nope)
    w_uv = torch.randn(heads, v_dim, ckv_dim, generator=gen, dtype=torch.float64)
    w_uv = w_uv / math.sqrt(ckv_dim)
    q_head = torch.randn(AXES["batch_size"], heads, nope, generator=gen, dtype=torch.float64)
    # Absorption: q_nope . ckv == q_head . (W_UK ckv).
    inputs["q_nope"] = torch.einsum("bhn,hnc->bhc", q_head, w_uk).float()
    output, lse = run(**inputs)
    for b in range(AXES["batch_size"]):
        latent = _latents(inputs, b, 16).double()
        ckv, kpe = latent[:, :ckv_dim], latent[:, ckv_dim:]
        for h in range(heads):
            q = torch.cat([q_head[b, h], inputs["q_pe"][b, h].double()])
            k = torch.cat([ckv @ w_uk[h].T, kpe], dim=1)
            v = ckv @ w_uv[h].T
            expected = F.scaled_dot_product_attention(q[None], k, v, scale=inputs["sm_scale"])[0]
            unabsorbed = w_uv[h] @ output[b, h].double()
            torch.testing.assert_close(unabsorbed, expected, atol=1e-5, rtol=1e-5)
            expected_lse = torch.logsumexp(k @ q * inputs["sm_scale"], dim=0) / math.log(2.0)
            torch.testing.assert_close(lse[b, h].double(), expected_lse, atol=1e-5, rtol=1e-5)


def test_mla_decode_matches_vllm_cpu_kernel() -> None:
    ops = pytest.importorskip("vllm._custom_ops", reason="vLLM CPU ops are not installed")
    inputs, run = _case("bfloat16", 16, seed=22)
    kv_cache = torch.cat([inputs["ckv_cache"], inputs["kpe_cache"]], dim=-1)
    indptr = inputs["kv_indptr"].tolist()
    table = torch.zeros(AXES["batch_size"], max(b - a for a, b in zip(indptr, indptr[1:])),
                        dtype=torch.int32)
    for r, (a, b) in enumerate(zip(indptr, indptr[1:])):
        table[r, : b - a] = inputs["kv_indices"][a:b]
    seq_lens = (inputs["kv_indptr"].diff() - 1) * 16 + inputs["kv_last_page_len"]
    engine = torch.zeros(AXES["batch_size"], 4, CONSTS["head_dim_ckv"], dtype=torch.bfloat16)
    query = torch.cat([inputs["q_nope"], inputs["q_pe"]], dim=-1).contiguous()
    ops.mla_decode_kvcache_cpu(engine, query, kv_cache, inputs["sm_scale"], table, seq_lens.int())
    torch.testing.assert_close(run(**inputs)[0], engine, atol=ENGINE_ATOL, rtol=ENGINE_RTOL)


def _reference(family: str, **consts):
    definition = get_template(family).instantiate(**consts)
    return definition, compile_reference(definition.reference, definition.name)


def test_prefill_rows_are_decodes_of_each_prefix() -> None:
    """Causal prefill row i of a request is the decode of that request's first L - n + i + 1
    tokens: the prefill reference, run once, equals the decode reference run per row."""
    consts = {"num_qo_heads": 4, "head_dim_ckv": 64, "head_dim_kpe": 16, "page_size": 4}
    template = get_template("mla_paged_prefill")
    prefill, run_prefill = _reference("mla_paged_prefill", **consts)
    _, run_decode = _reference("mla_paged_decode", **consts)
    axes = template.axes_for(prefill.const_axes, 0)  # two requests, cached prefixes
    inputs = template.synthetic_inputs(prefill, axes, seed=3)
    output, lse = run_prefill(**inputs)
    qo, kv = inputs["qo_indptr"].tolist(), inputs["kv_indptr"].tolist()
    last = inputs["kv_last_page_len"].tolist()
    checked = 0
    for b in range(len(qo) - 1):
        pages = inputs["kv_indices"][kv[b]:kv[b + 1]]
        length = (len(pages) - 1) * 4 + last[b]
        n = qo[b + 1] - qo[b]
        for i in range(n):
            seen = length - n + i + 1
            count = -(-seen // 4)
            row = qo[b] + i
            out_d, lse_d = run_decode(
                inputs["q_nope"][row:row + 1], inputs["q_pe"][row:row + 1],
                inputs["ckv_cache"], inputs["kpe_cache"],
                torch.tensor([0, count], dtype=torch.int32), pages[:count],
                torch.tensor([seen - (count - 1) * 4], dtype=torch.int32), inputs["sm_scale"])
            # one row's matmul may sum in another order than n rows' (BLAS blocking): the
            # float32 results can differ in the last bits and flip one bf16 rounding
            torch.testing.assert_close(out_d[0].float(), output[row].float(),
                                       rtol=2.0 ** -7, atol=1e-6)
            torch.testing.assert_close(lse_d[0], lse[row], rtol=1e-5, atol=1e-5)
            checked += 1
    assert checked == axes["total_q"] and any(
        (len(inputs["kv_indices"][kv[b]:kv[b + 1]]) - 1) * 4 + last[b] > qo[b + 1] - qo[b]
        for b in range(len(qo) - 1))  # some request had a cached prefix
