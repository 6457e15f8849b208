"""gqa_ragged_prefill / gqa_paged_decode: references against dense float64 attention and vLLM."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from enginetap.definitions import compile_reference, get_template
from enginetap.definitions.attention import split_lengths

HEADS = {"num_qo_heads": 8, "num_kv_heads": 2, "head_dim": 32}

# bf16 outputs of vLLM CPU kernels, on every kernel path (test_cpu_paths.py runs these tests
# on the AVX2 and AVX-512F paths too): AMX and vector kernels sum in float32 in their own
# order, and the AVX2/AVX-512F builds convert to bf16 by truncation (up to 1 ulp, i.e. 2**-7
# of the value, below where the AMX build rounds). 1e-2 absolute covers the summation order
# near zero; 3 * 2**-7 relative covers a truncation on top of our own rounding (2**-8).
ENGINE_ATOL, ENGINE_RTOL = 1e-2, 3 * 2.0 ** -7


def _dense64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
             kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One request, float64: q [Lq, H, D], k/v [Lk, Hkv, D]; queries end the kv (causal)."""
    q_len, kv_len, heads = q.shape[0], k.shape[0], q.shape[1]
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    outs, lses = [], []
    for h in range(heads):
        kv = h * kv_heads // heads
        qh, kh, vh = q[:, h].double(), k[:, kv].double(), v[:, kv].double()
        outs.append(F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed, scale=scale))
        logits = (qh @ kh.T * scale).masked_fill(~allowed, -math.inf)
        lses.append(torch.logsumexp(logits, dim=-1) / math.log(2.0))
    return torch.stack(outs, dim=1), torch.stack(lses, dim=1)


def _ragged(dtype: str, axes: dict[str, int], seed: int):
    template = get_template("gqa_ragged_prefill")
    definition = template.instantiate(**HEADS, dtype=dtype)
    inputs = template.synthetic_inputs(definition, axes, seed=seed)
    return inputs, compile_reference(definition.reference, definition.name)


def _paged(dtype: str, page_size: int, axes: dict[str, int], seed: int):
    template = get_template("gqa_paged_decode")
    definition = template.instantiate(**HEADS, page_size=page_size, dtype=dtype)
    inputs = template.synthetic_inputs(definition, axes, seed=seed)
    return inputs, compile_reference(definition.reference, definition.name)


def _tokens(cache: torch.Tensor, inputs: dict, b: int, page_size: int) -> torch.Tensor:
    """Request b's tokens, walked one slot at a time through its page list."""
    start, end = inputs["kv_indptr"][b].item(), inputs["kv_indptr"][b + 1].item()
    length = (end - start - 1) * page_size + inputs["kv_last_page_len"][b].item()
    pages = inputs["kv_indices"].tolist()
    return torch.stack([cache[pages[start + i // page_size], i % page_size] for i in range(length)])


def test_split_lengths_is_a_random_composition() -> None:
    gen = torch.Generator().manual_seed(0)
    draws = [split_lengths(40, 5, gen, "cpu", minimum=2) for _ in range(20)]
    assert all(sum(d) == 40 and min(d) >= 2 and len(d) == 5 for d in draws)
    assert len({tuple(d) for d in draws}) > 10
    assert split_lengths(5, 5, gen, "cpu") == [1] * 5


def test_ragged_generator_gives_prefixes_and_varied_lengths() -> None:
    inputs, _ = _ragged("bfloat16", {"total_q": 60, "total_kv": 150, "len_indptr": 6}, seed=5)
    q_lens = inputs["qo_indptr"].diff()
    kv_lens = inputs["kv_indptr"].diff()
    assert inputs["qo_indptr"][-1] == 60 and inputs["kv_indptr"][-1] == 150
    assert (q_lens >= 1).all() and (kv_lens >= q_lens).all() and (kv_lens > q_lens).any()
    assert len(set(q_lens.tolist())) > 1


def test_paged_generator_scatters_distinct_pages() -> None:
    axes = {"batch_size": 4, "len_indptr": 5, "num_pages": 40, "num_kv_indices": 20}
    inputs, _ = _paged("bfloat16", 16, axes, seed=6)
    pages = inputs["kv_indices"].tolist()
    assert len(set(pages)) == 20 and pages != sorted(pages) and max(pages) < 40
    assert (inputs["kv_indptr"].diff() >= 1).all() and inputs["kv_indptr"][-1] == 20
    assert ((inputs["kv_last_page_len"] >= 1) & (inputs["kv_last_page_len"] <= 16)).all()


def test_ragged_prefill_matches_dense_float64_attention() -> None:
    axes = {"total_q": 45, "total_kv": 120, "len_indptr": 5}
    inputs, run = _ragged("float32", axes, seed=7)
    output, lse = run(**inputs)
    qo, kv = inputs["qo_indptr"].tolist(), inputs["kv_indptr"].tolist()
    for b in range(len(qo) - 1):
        rows, keys = slice(qo[b], qo[b + 1]), slice(kv[b], kv[b + 1])
        expected, expected_lse = _dense64(inputs["q"][rows], inputs["k"][keys],
                                          inputs["v"][keys], inputs["sm_scale"], 2)
        torch.testing.assert_close(output[rows].double(), expected, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(lse[rows].double(), expected_lse, atol=2e-6, rtol=1e-5)


def test_paged_decode_matches_gathered_dense_float64_attention() -> None:
    axes = {"batch_size": 5, "len_indptr": 6, "num_pages": 30, "num_kv_indices": 16}
    inputs, run = _paged("float32", 8, axes, seed=8)
    output, lse = run(**inputs)
    assert inputs["kv_indptr"][1] == inputs["kv_indptr"][2]  # request 1 has no pages
    for b in range(5):
        if inputs["kv_indptr"][b] == inputs["kv_indptr"][b + 1]:
            assert not output[b].any() and bool((lse[b] == float("-inf")).all())
            continue
        k, v = (_tokens(inputs[c], inputs, b, 8) for c in ("k_cache", "v_cache"))
        expected, expected_lse = _dense64(inputs["q"][b:b + 1], k, v, inputs["sm_scale"], 2)
        torch.testing.assert_close(output[b].double(), expected[0], atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(lse[b].double(), expected_lse[0], atol=2e-6, rtol=1e-5)


def test_paged_decode_is_ragged_prefill_of_one_query() -> None:
    axes = {"batch_size": 3, "len_indptr": 4, "num_pages": 20, "num_kv_indices": 9}
    inputs, run = _paged("bfloat16", 16, axes, seed=9)
    keys = [_tokens(inputs["k_cache"], inputs, b, 16) for b in range(3)]
    values = [_tokens(inputs["v_cache"], inputs, b, 16) for b in range(3)]
    definition = get_template("gqa_ragged_prefill").instantiate(**HEADS, dtype="bfloat16")
    ragged = compile_reference(definition.reference)
    kv_indptr = torch.tensor([0, *torch.tensor([len(k) for k in keys]).cumsum(0).tolist()],
                             dtype=torch.int32)
    expected = ragged(inputs["q"], torch.cat(keys), torch.cat(values),
                      torch.arange(4, dtype=torch.int32), kv_indptr, inputs["sm_scale"])
    for got, want in zip(run(**inputs), expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


class _VllmCache:
    """vLLM CPU's own paged cache: keys/values written by its kernel, read by its attention."""

    def __init__(self, ops, kv: list[tuple[torch.Tensor, torch.Tensor]], block: int) -> None:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        self.ops, self.block = ops, block
        self.isa = _get_attn_isa(torch.bfloat16, block, HEADS["head_dim"])
        if self.isa == "amx":
            torch._C._cpu._init_amx()  # Linux grants AMX tiles only to processes that ask
        blocks = [-(-len(k) // block) for k, _ in kv]
        order = torch.randperm(sum(blocks) + 3, generator=torch.Generator().manual_seed(1))
        self.table = torch.zeros(len(kv), max(blocks), dtype=torch.int32)
        for r, n in enumerate(blocks):
            self.table[r, :n] = order[sum(blocks[:r]):sum(blocks[:r]) + n]
        shape = (sum(blocks) + 3, HEADS["num_kv_heads"], block * 2, HEADS["head_dim"])
        self.k, self.v = torch.zeros(shape, dtype=torch.bfloat16).chunk(2, dim=2)
        slots = torch.cat([self.table[r, torch.arange(len(k)) // block].long() * block
                           + torch.arange(len(k)) % block for r, (k, _) in enumerate(kv)])
        ops.cpu_attn_reshape_and_cache(torch.cat([k for k, _ in kv]), torch.cat([v for _, v in kv]),
                                       self.k, self.v, slots, self.isa)

    def attend(self, q: torch.Tensor, qo_indptr: torch.Tensor, seq_lens: torch.Tensor,
               scale: float) -> torch.Tensor:
        meta = self.ops.cpu_attn_get_scheduler_metadata(
            len(seq_lens), HEADS["num_qo_heads"], HEADS["num_kv_heads"], HEADS["head_dim"],
            seq_lens, torch.bfloat16, qo_indptr, True, -1, self.isa, False)
        out = torch.empty_like(q)
        self.ops.cpu_attention_with_kv_cache(q, self.k, self.v, out, qo_indptr, seq_lens, scale,
                                             True, None, -1, self.table, 0.0, meta, None)
        return out


def test_ragged_prefill_matches_vllm_cpu_attention() -> None:
    ops = pytest.importorskip("vllm._custom_ops", reason="vLLM CPU ops are not installed")
    inputs, run = _ragged("bfloat16", {"total_q": 40, "total_kv": 110, "len_indptr": 4}, seed=10)
    kv = inputs["kv_indptr"].tolist()
    cache = _VllmCache(ops, [(inputs["k"][a:b], inputs["v"][a:b]) for a, b in zip(kv, kv[1:])], 32)
    engine = cache.attend(inputs["q"], inputs["qo_indptr"], inputs["kv_indptr"].diff().int(),
                          inputs["sm_scale"])
    torch.testing.assert_close(run(**inputs)[0], engine, atol=ENGINE_ATOL, rtol=ENGINE_RTOL)


def test_paged_decode_matches_vllm_cpu_attention() -> None:
    ops = pytest.importorskip("vllm._custom_ops", reason="vLLM CPU ops are not installed")
    axes = {"batch_size": 4, "len_indptr": 5, "num_pages": 16, "num_kv_indices": 9}
    inputs, run = _paged("bfloat16", 32, axes, seed=11)
    kv = [(_tokens(inputs["k_cache"], inputs, b, 32), _tokens(inputs["v_cache"], inputs, b, 32))
          for b in range(4)]
    cache = _VllmCache(ops, kv, 32)
    seq_lens = torch.tensor([len(k) for k, _ in kv], dtype=torch.int32)
    engine = cache.attend(inputs["q"], torch.arange(5, dtype=torch.int32), seq_lens,
                          inputs["sm_scale"])
    torch.testing.assert_close(run(**inputs)[0], engine, atol=ENGINE_ATOL, rtol=ENGINE_RTOL)


@pytest.mark.parametrize("family", ["gqa_paged_decode", "mla_paged_decode"])
def test_last_page_length_outside_one_to_page_size_is_refused(family: str) -> None:
    template = get_template(family)
    definition = template.example_definition()
    axes = template.axes_for(definition.const_axes, 0)
    inputs = template.synthetic_inputs(definition, axes, seed=2)
    run = compile_reference(definition.reference, definition.name)
    for bad in (0, definition.const_axes["page_size"] + 1):
        inputs["kv_last_page_len"] = inputs["kv_last_page_len"].clone()
        inputs["kv_last_page_len"][0] = bad
        with pytest.raises(ValueError, match="kv_last_page_len"):
            run(**inputs)
