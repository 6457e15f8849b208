"""Seed-only MLA families with an attention sink (DeepSeek-V4-style sparse attention).

``mla_decode_fp8_fp4_sink``: absorbed decode over two quantized latent caches at once, an
FP8 one (recent tokens) and an FP4 one (compressed tokens), each addressed by slot lists.
``sparse_mla_prefill_sink``: prefill where each token attends its own top-k slots of a
bf16 latent cache, with per-token top-k lengths.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from enginetap.dataset.schema import Definition
from enginetap.definitions.base import Template, Tensor, const, var

if TYPE_CHECKING:
    import torch

__all__ = ["MLA_DECODE_FP8_FP4_SINK", "SPARSE_MLA_PREFILL_SINK"]

DECODE = "mla_decode_fp8_fp4_sink"
PREFILL = "sparse_mla_prefill_sink"

_ROWS = ("Valid slots of a row must be distinct (a repeated slot is refused: a gather kernel "
         "would attend it twice, a mask kernel once). A row's output depends only on the "
         "slots it attends: padding and ignored entries are never read, so non-finite values "
         "elsewhere in the cache (NaN codes, a reserved padding slot) cannot reach it. ")
_SINK = ("The sink adds exp(attn_sink[h]) to the softmax denominator and nothing to the "
         "numerator (-inf disables it). lse is the base-2 log-sum-exp of the attended scaled "
         "logits, sink excluded (-inf, with a zero output, when nothing is attended).")


def _lengths(rows: int, width: int, gen: torch.Generator, device: str) -> list[int]:
    """Valid entries per row: random in [1, width], the last row full."""
    import torch

    lengths = torch.randint(1, width + 1, (rows,), generator=gen, device=device).tolist()
    return [*lengths[:-1], width] if rows else []


def _generate_decode(definition: Definition, axes: Mapping[str, int], gen: torch.Generator,
                     device: str) -> dict[str, Any]:
    import torch

    from enginetap.definitions.seeded_quant import (
        e8m0_bytes, fp4_bytes, normal, padded_rows, quantize_fp8, spread)

    c = definition.const_axes
    batch, heads, ps = axes["batch"], c["num_heads"], c["page_size"]
    pages8, pages4 = axes["num_pages8"], axes["num_pages4"]
    latent = normal((pages8, ps, c["ckv_dim"]), gen, device) * spread((pages8, ps, 1), gen, device)
    ckv8, scale8 = quantize_fp8(latent, c["ckv_tiles"], gen)
    lengths4 = _lengths(batch, c["topk4"], gen, device)
    # The first sequence is too short to own compressed tokens yet: its FP4 row is empty.
    lengths4 = [0, *lengths4[1:]] if batch > 1 else lengths4
    return {
        "q_nope": normal((batch, heads, c["ckv_dim"]), gen, device, torch.bfloat16),
        "q_pe": normal((batch, heads, c["kpe_dim"]), gen, device, torch.bfloat16),
        "ckv8_cache": ckv8, "ckv8_scale": scale8,
        "kpe8_cache": normal((pages8, ps, c["kpe_dim"]), gen, device, torch.bfloat16),
        "ckv4_cache": fp4_bytes((pages4, ps, c["ckv_packed"]), gen, device),
        "ckv4_scale": e8m0_bytes((pages4, ps, c["ckv_groups"]), gen, device),
        "kpe4_cache": normal((pages4, ps, c["kpe_dim"]), gen, device, torch.bfloat16),
        "indices8": padded_rows(_lengths(batch, c["topk8"], gen, device), c["topk8"],
                                pages8 * ps, gen, device),
        "indices4": padded_rows(lengths4, c["topk4"], pages4 * ps, gen, device),
        "attn_sink": normal((heads,), gen, device),
        "sm_scale": 1.0 / math.sqrt(c["ckv_dim"] + c["kpe_dim"]),
    }


def _generate_prefill(definition: Definition, axes: Mapping[str, int], gen: torch.Generator,
                      device: str) -> dict[str, Any]:
    import torch

    from enginetap.definitions.seeded_quant import normal, require

    c = definition.const_axes
    tokens, pages, heads, ps, topk = (axes["num_tokens"], axes["num_pages"], c["num_heads"],
                                      c["page_size"], c["topk"])
    slots = pages * ps
    require(PREFILL, axes, slots >= topk, "num_pages * page_size >= topk (distinct slots)")
    # Every entry holds a real slot, also past topk_lens: the lengths alone must mask them.
    indices = torch.rand((tokens, slots), generator=gen, device=device).argsort(dim=-1)
    indices = indices[:, :topk].to(torch.int32)
    lengths = torch.tensor(_lengths(tokens, topk, gen, device), dtype=torch.int32, device=device)
    if tokens:
        indices[0, 0] = -1  # a hole inside the valid prefix of a row
    return {
        "q_nope": normal((tokens, heads, c["ckv_dim"]), gen, device, torch.bfloat16),
        "q_pe": normal((tokens, heads, c["kpe_dim"]), gen, device, torch.bfloat16),
        "ckv_cache": normal((pages, ps, c["ckv_dim"]), gen, device, torch.bfloat16),
        "kpe_cache": normal((pages, ps, c["kpe_dim"]), gen, device, torch.bfloat16),
        "sparse_indices": indices, "topk_lens": lengths,
        "attn_sink": normal((heads,), gen, device),
        "sm_scale": 1.0 / math.sqrt(c["ckv_dim"] + c["kpe_dim"]),
    }


def _decode_axes(consts: Mapping[str, int], index: int) -> dict[str, int]:
    """Pages enough for a full row of distinct slots in each scope, then more."""
    ps = consts["page_size"]
    base8, base4 = -(-consts["topk8"] // ps), -(-consts["topk4"] // ps)
    batch, extra8, extra4 = ((3, 1, 1), (1, 0, 0), (5, base8, base4 + 1), (2, 2, 0))[index % 4]
    return {"batch": batch, "num_pages8": base8 + extra8, "num_pages4": base4 + extra4}


def _prefill_axes(consts: Mapping[str, int], index: int) -> dict[str, int]:
    base = -(-consts["topk"] // consts["page_size"])
    tokens, pages = ((6, base + 3), (1, base), (13, 3 * base), (4, base + 1))[index % 4]
    return {"num_tokens": tokens, "num_pages": pages}


_MLA_AXES = {
    "num_heads": const("query heads"),
    "ckv_dim": const("latent (compressed KV) width"),
    "kpe_dim": const("rope key width"),
    "page_size": const("tokens per cache page"),
}
_ATTENTION_OUT = {"output": ("bfloat16", "attention output in latent space"),
                  "lse": ("float32", "base-2 log-sum-exp of the attended logits, sink excluded")}

MLA_DECODE_FP8_FP4_SINK = Template(
    family=DECODE,
    op_type="mla_paged",
    name="mla_decode_fp8_fp4_sink_h{num_heads}_ckv{ckv_dim}_kpe{kpe_dim}_ps{page_size}"
         "_fp8k{topk8}_fp4k{topk4}",
    description=(
        "MLA absorbed decode over an FP8 and an FP4 paged latent cache together. A slot is "
        "page * page_size + offset; -1 is padding. FP8 scope: latent = ckv8_cache (e4m3fn) * "
        "ckv8_scale (float32, one per token and tile of ckv_dim/ckv_tiles), rope = kpe8_cache "
        "(bf16). FP4 scope: latent = e2m1 codes of ckv4_cache (int8 bytes, element 2i in the "
        "low nibble, 2i+1 in the high one) * 2**(b-127) per 32 elements, b the unsigned E8M0 "
        "byte of ckv4_scale; rope = kpe4_cache (bf16). logits = sm_scale * (q_nope.latent + "
        "q_pe.rope), values = latent, softmax over both scopes' slots. Dequantised latents "
        "stay float32: they are not rounded to bf16 before the dot products or as values; "
        "everything is float32 until the output is cast to bf16. " + _ROWS + _SINK),
    axes={
        "batch": var("decoding sequences"),
        "num_pages8": var("pages of the FP8 cache"),
        "num_pages4": var("pages of the FP4 cache"),
        **_MLA_AXES,
        "ckv_tiles": const("FP8 scales per token"),
        "ckv_packed": const("ckv_dim // 2: bytes per FP4 latent"),
        "ckv_groups": const("ckv_dim // 32: E8M0 scales per FP4 latent"),
        "topk8": const("FP8 slots per query"),
        "topk4": const("FP4 slots per query"),
    },
    inputs={
        "q_nope": Tensor(("batch", "num_heads", "ckv_dim"), "bfloat16", "absorbed query"),
        "q_pe": Tensor(("batch", "num_heads", "kpe_dim"), "bfloat16", "rope query"),
        "ckv8_cache": Tensor(("num_pages8", "page_size", "ckv_dim"), "float8_e4m3fn"),
        "ckv8_scale": Tensor(("num_pages8", "page_size", "ckv_tiles"), "float32"),
        "kpe8_cache": Tensor(("num_pages8", "page_size", "kpe_dim"), "bfloat16"),
        "ckv4_cache": Tensor(("num_pages4", "page_size", "ckv_packed"), "int8", "packed e2m1"),
        "ckv4_scale": Tensor(("num_pages4", "page_size", "ckv_groups"), "int8", "E8M0 bytes"),
        "kpe4_cache": Tensor(("num_pages4", "page_size", "kpe_dim"), "bfloat16"),
        "indices8": Tensor(("batch", "topk8"), "int32", "FP8 slots, -1 padding"),
        "indices4": Tensor(("batch", "topk4"), "int32", "FP4 slots, -1 padding"),
        "attn_sink": Tensor(("num_heads",), "float32", "sink logit per head"),
        "sm_scale": Tensor(None, "float32", "softmax scale"),
    },
    outputs={"output": Tensor(("batch", "num_heads", "ckv_dim"), *_ATTENTION_OUT["output"]),
             "lse": Tensor(("batch", "num_heads"), *_ATTENTION_OUT["lse"])},
    reference="seed_mla_decode_fp8_fp4_sink.py",
    generate=_generate_decode,
    constraints=("ckv_dim % ckv_tiles == 0", "ckv_packed * 2 == ckv_dim",
                 "ckv_groups * 32 == ckv_dim"),
    tags=("seed-only", "quant:fp8_e4m3", "quant:fp4_e2m1", "attention_sink"),
    example={"num_heads": 4, "ckv_dim": 128, "kpe_dim": 32, "page_size": 8, "ckv_tiles": 2,
             "ckv_packed": 64, "ckv_groups": 4, "topk8": 16, "topk4": 12},
    example_axes={"batch": 3, "num_pages8": 6, "num_pages4": 5},
    workload_axes=_decode_axes,
)

SPARSE_MLA_PREFILL_SINK = Template(
    family=PREFILL,
    op_type="dsa_attention",
    name="sparse_mla_prefill_sink_h{num_heads}_ckv{ckv_dim}_kpe{kpe_dim}_ps{page_size}"
         "_topk{topk}",
    description=(
        "Sparse MLA prefill: token t attends the slots sparse_indices[t, j] (page * page_size "
        "+ offset into the bf16 ckv/kpe caches) for j < topk_lens[t] that are not -1; later "
        "entries are ignored. logits = sm_scale * (q_nope.ckv + q_pe.kpe), values = ckv, in "
        "float32. " + _ROWS + _SINK),
    axes={
        "num_tokens": var("query tokens of the batch"),
        "num_pages": var("pages of the latent cache"),
        **_MLA_AXES,
        "topk": const("slots per query token"),
    },
    inputs={
        "q_nope": Tensor(("num_tokens", "num_heads", "ckv_dim"), "bfloat16", "absorbed query"),
        "q_pe": Tensor(("num_tokens", "num_heads", "kpe_dim"), "bfloat16", "rope query"),
        "ckv_cache": Tensor(("num_pages", "page_size", "ckv_dim"), "bfloat16"),
        "kpe_cache": Tensor(("num_pages", "page_size", "kpe_dim"), "bfloat16"),
        "sparse_indices": Tensor(("num_tokens", "topk"), "int32", "slots, -1 padding"),
        "topk_lens": Tensor(("num_tokens",), "int32", "valid prefix of each row"),
        "attn_sink": Tensor(("num_heads",), "float32", "sink logit per head"),
        "sm_scale": Tensor(None, "float32", "softmax scale"),
    },
    outputs={"output": Tensor(("num_tokens", "num_heads", "ckv_dim"), *_ATTENTION_OUT["output"]),
             "lse": Tensor(("num_tokens", "num_heads"), *_ATTENTION_OUT["lse"])},
    reference="seed_sparse_mla_prefill_sink.py",
    generate=_generate_prefill,
    tags=("seed-only", "attention_sink"),
    example={"num_heads": 4, "ckv_dim": 64, "kpe_dim": 16, "page_size": 4, "topk": 8},
    example_axes={"num_tokens": 6, "num_pages": 5},
    workload_axes=_prefill_axes,
)
