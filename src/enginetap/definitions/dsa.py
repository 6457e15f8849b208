"""DeepSeek sparse attention (DSA, DeepSeek-V3.2): lightning indexer and sparse MLA.

The indexer picks, for every query token, the ``index_topk`` best keys of its own
sequence; sparse MLA then attends over exactly those cache rows. Both address keys by
their row in a flat buffer (the indexer's ``k_index`` rows, the cache's
``page * page_size + offset``), so an indexer output whose key rows line up with the MLA
cache rows is directly a ``sparse_indices`` input. ``-1`` marks padding in both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from enginetap.dataset.schema import Definition
from enginetap.definitions.base import CompareRule, Template, Tensor, const, var
from enginetap.errors import DefinitionError

if TYPE_CHECKING:
    import torch

__all__ = ["INDEXER_TOPK", "SPARSE_MLA"]


def _split(total: int, parts: int, gen: torch.Generator, device: str, minimum: int) -> list[int]:
    """``total`` cut into ``parts`` random sizes, each at least ``minimum``."""
    import torch

    spare = total - parts * minimum
    cuts = torch.randint(0, spare + 1, (parts - 1,), generator=gen, device=device).sort().values
    edges = [0, *cuts.tolist(), spare]
    return [minimum + edges[j + 1] - edges[j] for j in range(parts)]


def _key_ranges(num_tokens: int, num_keys: int, gen: torch.Generator,
                device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token visible key range ``[start, end)`` of a batch of ragged sequences.

    Each sequence holds its cached keys followed by its new tokens' keys; a new token sees
    its sequence's keys up to and including its own. The first sequence has no cache (a
    fresh prefill, so early tokens see fewer keys than ``index_topk``); the last one is a
    one-token decode whenever there is room for two sequences.
    """
    import torch

    if num_keys < num_tokens:
        raise DefinitionError("cannot generate dsa_indexer_topk inputs",
                              f"num_keys {num_keys} < num_tokens {num_tokens}",
                              "give at least one key per query token")
    parts = max(1, min(4, num_tokens // 4))
    if parts == 1:
        q_lens, cached = [num_tokens], [num_keys - num_tokens]
    else:
        q_lens = [*_split(num_tokens - 1, parts - 1, gen, device, 1), 1]
        cached = [0, *_split(num_keys - num_tokens, parts - 1, gen, device, 0)]
    start, end, base = [], [], 0
    for q_len, prefix in zip(q_lens, cached):
        for i in range(q_len):
            start.append(base)
            end.append(base + prefix + i + 1)
        base += prefix + q_len
    as_int = {"dtype": torch.int32, "device": device}
    return torch.tensor(start, **as_int), torch.tensor(end, **as_int)


def _indexer_inputs(definition: Definition, axes: Mapping[str, int],
                    gen: torch.Generator, device: str) -> dict[str, Any]:
    import torch

    c = definition.const_axes
    n, keys = axes["num_tokens"], axes["num_keys"]
    heads, dim = c["index_n_heads"], c["index_head_dim"]
    start, end = _key_ranges(n, keys, gen, device)
    # A shared offset makes most dot products positive: a score of exactly zero (every
    # head clipped by the relu) ties with every other such key, which with few heads
    # would otherwise be common.
    q = torch.randn(n, heads, dim, generator=gen, device=device) + 0.7
    k = torch.randn(keys, dim, generator=gen, device=device) + 0.7
    if keys > 2:
        k[2] = k[1]  # rows 1 and 2 score equally for every token: the lower row must win
    # Signed head weights carrying the n_heads^-0.5 and head_dim^-0.5 factors, as engines
    # pass them to the scoring kernel.
    w = torch.randn(n, heads, generator=gen, device=device) * (heads * dim) ** -0.5
    return {"q_index": q.to(torch.bfloat16), "k_index": k.to(torch.bfloat16), "weights": w,
            "key_start": start, "key_end": end}


def _sparse_mla_inputs(definition: Definition, axes: Mapping[str, int],
                       gen: torch.Generator, device: str) -> dict[str, Any]:
    import torch

    c = definition.const_axes
    n, pages = axes["num_tokens"], axes["num_pages"]
    h, ckv, kpe, topk, ps = (c["num_qo_heads"], c["head_dim_ckv"], c["head_dim_kpe"],
                             c["topk"], c["page_size"])
    slots = pages * ps

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(torch.bfloat16)

    # Distinct rows per token; about half of the tokens see fewer than topk keys, their
    # -1 padding placed anywhere in the row.
    rows = torch.rand(n, slots, generator=gen, device=device).argsort(dim=-1)[:, :topk]
    counts = torch.randint(1, topk + 1, (n,), generator=gen, device=device)
    counts[::2] = min(topk, slots)
    slot = torch.arange(rows.shape[1], device=device)
    rows = torch.where(slot < counts.unsqueeze(-1), rows, -1)
    shuffle = torch.rand(n, rows.shape[1], generator=gen, device=device).argsort(dim=-1)
    indices = torch.full((n, topk), -1, dtype=torch.int32, device=device)
    indices[:, : rows.shape[1]] = rows.gather(-1, shuffle).to(torch.int32)
    return {"q_nope": randn(n, h, ckv), "q_pe": randn(n, h, kpe),
            "ckv_cache": randn(pages, ps, ckv), "kpe_cache": randn(pages, ps, kpe),
            # DeepSeek's scale: its query head is qk_nope_head_dim (128) + the rotary part.
            "sparse_indices": indices, "sm_scale": (128 + kpe) ** -0.5}


def _indexer_axes(consts: Mapping[str, int], index: int) -> dict[str, int]:
    tokens, keys = ((24, 64), (1, 40), (9, 9), (30, 120))[index % 4]
    return {"num_tokens": tokens, "num_keys": keys}


def _sparse_mla_axes(consts: Mapping[str, int], index: int) -> dict[str, int]:
    """Enough pages for topk distinct rows (the constraint), then more."""
    base = -(-consts["topk"] // consts["page_size"])
    tokens, pages = ((12, 6 * base), (1, base), (5, 2 * base), (20, 3 * base))[index % 4]
    return {"num_tokens": tokens, "num_pages": pages}


INDEXER_TOPK = Template(
    family="dsa_indexer_topk",
    op_type="dsa_indexer",
    name="dsa_indexer_topk_h{index_n_heads}_d{index_head_dim}_topk{index_topk}",
    description=(
        "DeepSeek-V3.2 lightning indexer, bf16 keys in one flat buffer: for query token t "
        "and key row s in [key_start[t], key_end[t]), score = sum_h weights[t, h] * "
        "relu(q_index[t, h] . k_index[s]) in float32; topk_indices[t] lists the index_topk "
        "best rows of k_index (absolute rows, best first, equal scores by lower row), -1 "
        "after the last visible key when fewer are visible. q and k carry RoPE already "
        "(and the Hadamard rotation, if the engine applies one: it leaves dot products "
        "unchanged). Engine mapping: transformers `DeepseekV32Indexer.forward` computes "
        "weights_proj(x) * n_heads^-0.5 and multiplies the dot products by "
        "softmax_scale = head_dim^-0.5; since relu(a*x) = a*relu(x) for a > 0 both factors "
        "belong in `weights` here. Its rows of the batch's key cache flatten to k_index "
        "(row b*T + i), its causal mask gives key_start/key_end, and the indices it returns "
        "for masked keys (score -inf, when fewer than index_topk are visible) are -1 here. "
        "Keys are not paged: gather paged engine caches into rows first. `scores` is every "
        "key's score (-inf where not visible); engines need not expose it. Replay compares "
        "the index sets, forgiving a differing index only when its score ties (within "
        "atol) with the one it replaced: equal scores at the top-k boundary (common after "
        "the relu: several keys score exactly 0) have no defined order in engines' top-k."),
    axes={"num_tokens": var("Query tokens in this call (all sequences)."),
          "num_keys": var("Rows of the flat indexer key buffer."),
          "index_n_heads": const("Indexer heads."),
          "index_head_dim": const("Indexer head size."),
          "index_topk": const("Keys kept per query token.")},
    inputs={
        "q_index": Tensor(("num_tokens", "index_n_heads", "index_head_dim"), "bfloat16",
                          "Indexer queries (after RoPE)."),
        "k_index": Tensor(("num_keys", "index_head_dim"), "bfloat16",
                          "Indexer keys of every sequence, one row per cached token."),
        "weights": Tensor(("num_tokens", "index_n_heads"), "float32",
                          "Per-head weights, all scale factors included."),
        "key_start": Tensor(("num_tokens",), "int32", "First key row visible to the token."),
        "key_end": Tensor(("num_tokens",), "int32", "One past the last visible key row."),
    },
    outputs={"topk_indices": Tensor(("num_tokens", "index_topk"), "int32",
                                    "Chosen k_index rows, -1 = padding."),
             "scores": Tensor(("num_tokens", "num_keys"), "float32",
                              "Every key's score, -inf where not visible.")},
    reference="dsa_indexer_topk.py",
    generate=_indexer_inputs,
    compare={"topk_indices": CompareRule(kind="selection", scores="scores")},
    tags=("stage:dsa_indexer",),
    engines=("transformers",),
    example={"index_n_heads": 8, "index_head_dim": 64, "index_topk": 16},
    example_axes={"num_tokens": 24, "num_keys": 64},
    workload_axes=_indexer_axes,
)

SPARSE_MLA = Template(
    family="dsa_sparse_mla",
    op_type="dsa_attention",
    name="dsa_sparse_attention_h{num_qo_heads}_ckv{head_dim_ckv}_kpe{head_dim_kpe}"
         "_topk{topk}_ps{page_size}",
    description=(
        "DeepSeek-V3.2 sparse MLA in the absorbed (latent) form, the semantics of "
        "FlashInfer-Trace's dsa_sparse_attention definitions: for token t, the keys are "
        "the cache rows named by sparse_indices[t] (row = page * page_size + offset; -1 = "
        "padding, anywhere in the row; valid rows distinct, a repeated row is refused), "
        "logits = sm_scale * (q_nope . "
        "ckv + q_pe . kpe), output = softmax(logits) @ ckv in float32 cast to bf16, lse = "
        "log2-sum-exp of the logits. A token without any valid index outputs zeros and "
        "lse -inf. A token's output depends only on the rows it names (padding reads nothing, so "
        "non-finite values elsewhere in the cache cannot reach it). Causality comes only from "
        "the indices. Engine mapping: FlashMLA "
        "`flash_mla_sparse_fwd` (kv = cat(ckv, kpe), h_kv = 1) and FlashInfer's TRT-LLM "
        "MLA with sparse_mla_top_k; transformers' eager path is the same attention over a "
        "dense mask built from the indexer's choices."),
    axes={"num_tokens": var("Query tokens in this call."),
          "num_pages": var("Pages of the latent cache."),
          "num_qo_heads": const("Query heads (per TP rank)."),
          "head_dim_ckv": const("Latent (compressed kv) size: kv_lora_rank."),
          "head_dim_kpe": const("Rotary key size: qk_rope_head_dim."),
          "topk": const("Index slots per token (index_topk)."),
          "page_size": const("Tokens per cache page.")},
    inputs={
        "q_nope": Tensor(("num_tokens", "num_qo_heads", "head_dim_ckv"), "bfloat16",
                         "Query, non-rotary part absorbed into the latent space."),
        "q_pe": Tensor(("num_tokens", "num_qo_heads", "head_dim_kpe"), "bfloat16",
                       "Query, rotary part."),
        "ckv_cache": Tensor(("num_pages", "page_size", "head_dim_ckv"), "bfloat16",
                            "Latent cache (keys and values)."),
        "kpe_cache": Tensor(("num_pages", "page_size", "head_dim_kpe"), "bfloat16",
                            "Rotary key cache."),
        "sparse_indices": Tensor(("num_tokens", "topk"), "int32",
                                 "Cache rows each token attends to, -1 = padding."),
        "sm_scale": Tensor(None, "float32", "Softmax scale, e.g. (qk_nope + qk_rope)^-0.5."),
    },
    outputs={"output": Tensor(("num_tokens", "num_qo_heads", "head_dim_ckv"), "bfloat16",
                              "Attention output in the latent space."),
             "lse": Tensor(("num_tokens", "num_qo_heads"), "float32",
                           "Base-2 log-sum-exp of the scaled logits.")},
    reference="dsa_sparse_mla.py",
    generate=_sparse_mla_inputs,
    compare={"output": CompareRule(atol=1e-2, rtol=2e-2),
             "lse": CompareRule(atol=1e-3, rtol=1e-3)},
    constraints=("topk <= num_pages * page_size",),
    tags=("stage:dsa_attention",),
    engines=(),
    example={"num_qo_heads": 4, "head_dim_ckv": 512, "head_dim_kpe": 64, "topk": 32,
             "page_size": 4},
    example_axes={"num_tokens": 12, "num_pages": 24},
    workload_axes=_sparse_mla_axes,
)
