"""Seed-only block-sparse attention families (Qwen-style compressed sparse attention).

``compressed_sparse_topk``: an indexer scores one compressed key per block of tokens and
keeps the best ``topk`` blocks per query token. ``sparse_gqa_paged_decode``: GQA decode
that attends only the tokens of the selected blocks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from enginetap.dataset.schema import Definition
from enginetap.definitions.base import CompareRule, Template, Tensor, const, var

if TYPE_CHECKING:
    import torch

__all__ = ["COMPRESSED_SPARSE_TOPK", "SPARSE_GQA_PAGED_DECODE"]

TOPK = "compressed_sparse_topk"
DECODE = "sparse_gqa_paged_decode"


def _visible_blocks(tokens: int, max_blocks: int, topk: int, gen: torch.Generator,
                    device: str) -> list[int]:
    """Blocks each token sees: random, plus a token that sees none, one that sees fewer
    than ``topk`` (padding) and one that sees them all."""
    import torch

    visible = torch.randint(0, max_blocks + 1, (tokens,), generator=gen, device=device).tolist()
    for row, count in ((0, 0), (1, min(topk - 1, max_blocks)), (tokens - 1, max_blocks)):
        if 0 <= row < tokens:
            visible[row] = count
    return visible


def _generate_topk(definition: Definition, axes: Mapping[str, int], gen: torch.Generator,
                   device: str) -> dict[str, Any]:
    import torch

    from enginetap.definitions.seeded_quant import normal, page_rows

    c = definition.const_axes
    tokens, pages, max_pages = axes["num_tokens"], axes["num_pages"], axes["max_pages"]
    ps, bs, heads, dim = c["page_size"], c["block_size"], c["num_heads"], c["head_dim"]
    visible = _visible_blocks(tokens, max_pages * ps, c["topk"], gen, device)
    # A partial trailing block is not compressed yet: it adds tokens but no block.
    partial = torch.randint(0, bs, (tokens,), generator=gen, device=device)
    seq_lens = (torch.tensor(visible, device=device) * bs + partial).to(torch.int32)
    kc_cache = normal((pages, ps, dim), gen, device, torch.bfloat16)
    if pages * ps > 1:
        kc_cache.view(-1, dim)[1] = kc_cache.view(-1, dim)[0]  # two blocks whose scores tie
    return {
        "q": normal((tokens, heads, dim), gen, device, torch.bfloat16),
        "weights": normal((tokens, heads), gen, device) / math.sqrt(heads),
        "kc_cache": kc_cache,
        "page_table": page_rows(visible, ps, max_pages, pages, gen, device),
        "seq_lens": seq_lens,
    }


def _selections(lengths: list[int], sel: int, topk: int, block_size: int,
                gen: torch.Generator, device: str) -> torch.Tensor:
    """Block ids ``[len(lengths), sel, topk]``: the block being written (often partial) comes
    first, as a decode always needs its recent tokens; then random older blocks, then -1."""
    import torch

    from enginetap.definitions.seeded_quant import padded_rows

    rows = []
    for length in lengths:
        current = -(-length // block_size) - 1
        extra = torch.randint(0, min(topk - 1, current) + 1, (sel,), generator=gen, device=device)
        older = padded_rows(extra.tolist(), topk - 1, current, gen, device)
        newest = torch.full((sel, 1), current, dtype=torch.int32, device=device)
        rows.append(torch.cat((newest, older), dim=1))
    if not rows:
        return torch.zeros(0, sel, topk, dtype=torch.int32, device=device)
    return torch.stack(rows)


def _generate_decode(definition: Definition, axes: Mapping[str, int], gen: torch.Generator,
                     device: str) -> dict[str, Any]:
    import torch

    from enginetap.definitions.seeded_quant import normal, page_rows, require

    c = definition.const_axes
    batch, pages, max_pages, sel = (axes["batch"], axes["num_pages"], axes["max_pages"],
                                    axes["sel_heads"])
    ps, bs, topk, kv, dim = (c["page_size"], c["block_size"], c["topk"], c["num_kv_heads"],
                             c["head_dim"])
    require(DECODE, axes, sel in (1, kv), "sel_heads == 1 or sel_heads == num_kv_heads")
    lengths = torch.randint(1, max_pages * ps + 1, (batch,), generator=gen, device=device)
    lengths[-1:] = max_pages * ps
    cache = (pages, ps, kv, dim)
    return {
        "q": normal((batch, c["num_qo_heads"], dim), gen, device, torch.bfloat16),
        "k_cache": normal(cache, gen, device, torch.bfloat16),
        "v_cache": normal(cache, gen, device, torch.bfloat16),
        "page_table": page_rows(lengths.tolist(), ps, max_pages, pages, gen, device),
        "seq_lens": lengths.to(torch.int32),
        "block_ids": _selections(lengths.tolist(), sel, topk, bs, gen, device),
        "sm_scale": 1.0 / math.sqrt(dim),
    }


def _topk_axes(consts: Mapping[str, int], index: int) -> dict[str, int]:
    tokens, pages, max_pages = ((7, 10, 4), (1, 3, 3), (12, 20, 6), (3, 5, 5))[index % 4]
    return {"num_tokens": tokens, "num_pages": pages, "max_pages": max_pages}


def _decode_axes(consts: Mapping[str, int], index: int) -> dict[str, int]:
    """Per-KV-head selections and the seed's shared selection (sel_heads == 1) in turn."""
    batch, pages, max_pages = ((3, 12, 4), (2, 8, 4), (1, 4, 4), (5, 20, 4))[index % 4]
    sel = consts["num_kv_heads"] if index % 2 == 0 else 1
    return {"batch": batch, "num_pages": pages, "max_pages": max_pages, "sel_heads": sel}


COMPRESSED_SPARSE_TOPK = Template(
    family=TOPK,
    op_type="sparse_index",
    name="compressed_sparse_topk_h{num_heads}_d{head_dim}_c{block_size}_ps{page_size}"
         "_topk{topk}_relu{relu:d}",
    description=(
        "Block-level sparse-attention indexer. The seed names this op by its block ids only; "
        "the weighted-relu score below and the scores output are enginetap's own reading of "
        "it (the DeepSeek lightning-indexer score applied to compressed keys), not the seed's "
        "words. The cache holds one compressed key per "
        "complete block of block_size tokens; logical block b of token t is at "
        "kc_cache[page_table[t, b // page_size], b % page_size]. Token t sees blocks "
        "b < seq_lens[t] // block_size. score = sum_h weights[t,h] * f(q[t,h].key), f = relu "
        "when the parameter relu is true (else identity), in float32. block_ids[t]: the "
        "min(topk, visible) best blocks in increasing id order, then -1; ties go to the lower "
        "id. scores[t, p, s]: score of block p * page_size + s, -inf where not visible."),
    axes={
        "num_tokens": var("query tokens"),
        "num_pages": var("pages of the compressed cache"),
        "max_pages": var("page-table width"),
        "num_heads": const("indexer heads"),
        "head_dim": const("indexer head width"),
        "page_size": const("compressed keys per page"),
        "block_size": const("tokens per compressed key (compression ratio)"),
        "topk": const("blocks kept per token"),
    },
    inputs={
        "q": Tensor(("num_tokens", "num_heads", "head_dim"), "bfloat16", "indexer queries"),
        "weights": Tensor(("num_tokens", "num_heads"), "float32", "per-head score weights"),
        "kc_cache": Tensor(("num_pages", "page_size", "head_dim"), "bfloat16",
                           "compressed keys"),
        "page_table": Tensor(("num_tokens", "max_pages"), "int32", "each token's pages"),
        "seq_lens": Tensor(("num_tokens",), "int32", "tokens each query sees (position + 1)"),
    },
    outputs={
        "block_ids": Tensor(("num_tokens", "topk"), "int32", "selected blocks, -1 padding"),
        "scores": Tensor(("num_tokens", "max_pages", "page_size"), "float32",
                         "score of every logical block"),
    },
    reference="seed_compressed_sparse_topk.py",
    generate=_generate_topk,
    compare={"block_ids": CompareRule(kind="selection", scores="scores")},
    params={"relu": True},
    tags=("seed-only",),
    # page_size != block_size: one counts compressed keys per page, the other tokens per key.
    example={"num_heads": 4, "head_dim": 32, "page_size": 8, "block_size": 4, "topk": 6},
    example_axes={"num_tokens": 7, "num_pages": 10, "max_pages": 4},
    workload_axes=_topk_axes,
)

SPARSE_GQA_PAGED_DECODE = Template(
    family=DECODE,
    op_type="gqa_paged",
    name="sparse_gqa_paged_decode_h{num_qo_heads}_kv{num_kv_heads}_d{head_dim}_ps{page_size}"
         "_c{block_size}_topk{topk}",
    description=(
        "GQA decode over a paged KV cache restricted to selected token blocks. Block b covers "
        "tokens b*block_size .. (b+1)*block_size-1; token i of sequence s is at "
        "[page_table[s, i // page_size], i % page_size]. Query head h (KV head g = h // "
        "(num_qo_heads / num_kv_heads)) attends the tokens before seq_lens[s] of the blocks "
        "block_ids[s, g] (block_ids[s, 0] for every head when sel_heads == 1: the shared "
        "selection of the seed); -1 is padding. The valid blocks of a selection must be "
        "distinct (a repeated block is refused). A head's output depends only on the tokens "
        "it attends (non-finite values elsewhere in the cache never reach it). lse: base-2 "
        "log-sum-exp of the scaled logits (-inf, with a zero output, when nothing is attended)."),
    axes={
        "batch": var("decoding sequences"),
        "num_pages": var("pages of the KV cache"),
        "max_pages": var("page-table width"),
        "sel_heads": var("1 (shared selection) or num_kv_heads"),
        "num_qo_heads": const("query heads"),
        "num_kv_heads": const("KV heads"),
        "head_dim": const("head width"),
        "page_size": const("tokens per page"),
        "block_size": const("tokens per selectable block"),
        "topk": const("blocks per selection"),
    },
    inputs={
        "q": Tensor(("batch", "num_qo_heads", "head_dim"), "bfloat16"),
        "k_cache": Tensor(("num_pages", "page_size", "num_kv_heads", "head_dim"), "bfloat16"),
        "v_cache": Tensor(("num_pages", "page_size", "num_kv_heads", "head_dim"), "bfloat16"),
        "page_table": Tensor(("batch", "max_pages"), "int32"),
        "seq_lens": Tensor(("batch",), "int32", "tokens in each sequence"),
        "block_ids": Tensor(("batch", "sel_heads", "topk"), "int32", "blocks, -1 padding"),
        "sm_scale": Tensor(None, "float32", "softmax scale"),
    },
    outputs={"output": Tensor(("batch", "num_qo_heads", "head_dim"), "bfloat16"),
             "lse": Tensor(("batch", "num_qo_heads"), "float32", "base-2 log-sum-exp")},
    reference="seed_sparse_gqa_paged_decode.py",
    generate=_generate_decode,
    constraints=("num_qo_heads % num_kv_heads == 0",
                 "sel_heads == 1 or sel_heads == num_kv_heads"),
    tags=("seed-only",),
    example={"num_qo_heads": 8, "num_kv_heads": 2, "head_dim": 32, "page_size": 8,
             "block_size": 4, "topk": 5},
    example_axes={"batch": 3, "num_pages": 12, "max_pages": 4, "sel_heads": 2},
    workload_axes=_decode_axes,
)
