"""DeepSeek sparse attention probes of the built-in engine (DeepSeek-V3.2).

``dsa_indexer_topk`` — ``DeepseekV32Indexer.forward(hidden_states, q_resid, position_embeddings,
attention_mask [B, S, T], position_ids, past_key_values)`` returns the engine's own top-k
cache columns ``[B, S, k]``. Inputs: ``q_index`` recomputed from ``q_resid`` with the
indexer's ``wq_b`` and RoPE (the same ops on the same tensors), ``k_index`` the indexer key
cache as the engine holds it after the call, ``weights = weights_proj(x) * n_heads^-0.5 *
softmax_scale`` (both positive factors move inside the relu, as the definition says). Each
request's live key columns are packed in cache order into one flat key buffer; the engine's
columns become rows of it, and its picks of masked keys (when fewer than ``index_topk`` are
visible, ``topk`` returns -inf entries) become -1.

``dsa_sparse_mla`` — ``DeepseekV32Attention.forward``: as for dense MLA
(:mod:`~enginetap.engines.hf.probes.mla`) the engine runs un-absorbed and never forms the
latent output, so inputs are reconstructed and checked against the layer's real output, and
no output is stored. The keys each token attends are the indexer's choice; the indexer ran
inside this forward, so its choice is recomputed op for op from its own key cache.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from enginetap.capture.probe import Extracted, Probe, ProbeCall
from enginetap.dataset.schema import Definition
from enginetap.engines.hf.probes.attention import PAGE_SIZE
from enginetap.engines.hf.probes.common import (
    PAD_NOTE,
    BatchRequest,
    batch_requests,
    column_ranges,
    end_aligned,
    fill_pages,
    instantiate,
    pack_pages,
    visible_columns,
)
from enginetap.engines.hf.probes.mla import (
    absorbed_query,
    check_against_engine,
    latent_cache,
    rms_norm_as_engine,
)

__all__ = ["DSA_PROBES"]


def _live(requests: list[BatchRequest], mask: torch.Tensor | None,
          kv_len: int) -> tuple[list[list[int]], list[torch.Tensor]] | None:
    """Per request: live key columns and ``[queries, kv_len]`` visibility, or None when a
    request's queries do not sit at the end of their keys."""
    lives, seens = [], []
    for r in requests:
        q_len = mask.shape[-2] if mask is not None else max(r.columns) + 1
        seen = visible_columns(mask, False, r.batch_row, q_len, kv_len)
        live, ok = end_aligned(seen, r.columns)
        if not ok:
            return None
        lives.append(live)
        seens.append(seen[r.columns])
    return lives, seens


def _indexer_query(indexer: Any, q_resid: torch.Tensor,
                   position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``[B, S, heads, head_dim]``: the indexer's query as its forward computes it."""
    batch, seq = q_resid.shape[:2]
    q = indexer.wq_b(q_resid).view(batch, seq, indexer.n_heads, indexer.head_dim)
    rot, rest = torch.split(q, [indexer.qk_rope_head_dim,
                                indexer.head_dim - indexer.qk_rope_head_dim], dim=-1)
    cos, sin = position_embeddings
    rot, _ = sys.modules[type(indexer).__module__].apply_rotary_pos_emb(
        rot, rot[:, :, :1], cos, sin, unsqueeze_dim=2)
    return torch.cat([rot, rest], dim=-1)


def _indexer_weights(indexer: Any, hidden: torch.Tensor) -> torch.Tensor:
    return indexer.weights_proj(hidden.to(indexer.weights_proj.weight.dtype)).float() * (
        indexer.n_heads ** -0.5)


def _define_indexer(call: ProbeCall) -> Definition | None:
    module = call.instance
    if call.args.get("past_key_values") is None or not hasattr(module, "index_topk"):
        return None
    return instantiate("dsa_indexer_topk", index_n_heads=int(module.n_heads),
                       index_head_dim=int(module.head_dim), index_topk=int(module.index_topk))


_INDEXER_NOTES = [
    "q_index: recomputed from q_resid with the indexer's wq_b and RoPE (same ops)",
    "weights: weights_proj(x) * n_heads^-0.5 * softmax_scale (positive factors moved inside "
    "the relu)",
    "topk_indices: the engine's cache columns mapped to key rows; its picks of masked keys "
    "(fewer visible than index_topk) and missing slots are -1"]


def _picks_as_rows(columns: list[int], seen: torch.Tensor, row_of: dict[int, int],
                   topk: int) -> list[int]:
    """Chosen cache columns as rows of the packed key buffer; masked picks and missing
    slots (fewer keys than ``topk``) are -1."""
    rows = [row_of[c] if bool(seen[c]) else -1 for c in columns]
    return rows + [-1] * (topk - len(rows))


def _adapt_indexer(call: ProbeCall) -> Extracted | None:
    module, a = call.instance, call.args
    keys = a["past_key_values"].layers[module.layer_idx].indexer_keys
    requests = batch_requests(call)
    found = _live(requests, a["attention_mask"], keys.shape[1])
    if found is None:
        return None
    q = _indexer_query(module, a["q_resid"], a["position_embeddings"])
    weights = _indexer_weights(module, a["hidden_states"]) * module.softmax_scale
    scores = _index_scores(module, q, keys, a["hidden_states"], a["attention_mask"])
    tokens, ks, ends, picks, notes, base = [], [], [], [], [PAD_NOTE], 0
    for r, live, seen in zip(requests, *found):
        row_of = {c: base + i for i, c in enumerate(live)}
        ks.append(keys[r.batch_row, live])
        tokens += [(r.batch_row, c, base) for c in r.columns]
        ends += [base + int(seen[i].sum()) for i in range(len(r.columns))]
        picks += [_picks_as_rows(call.result[r.batch_row, c].tolist(), seen[i], row_of,
                                 module.index_topk) for i, c in enumerate(r.columns)]
        notes.append(f"request {r.key}: key rows {base}..{base + len(live) - 1} are its "
                     f"indexer cache columns {column_ranges(live)} of batch row {r.batch_row}")
        base += len(live)
    inputs = {"q_index": torch.stack([q[b, c] for b, c, _ in tokens]),
              "k_index": torch.cat(ks),
              "weights": torch.stack([weights[b, c] for b, c, _ in tokens]).float(),
              "key_start": torch.tensor([s for _, _, s in tokens], dtype=torch.int32),
              "key_end": torch.tensor(ends, dtype=torch.int32)}
    ties = _boundary_ties(torch.stack([scores[b, c] for b, c, _ in tokens]), module.index_topk)
    if ties:
        notes.append(f"{ties} token(s) have exactly equal scores at the top-k boundary: the "
                     "engine's torch.topk chose among them in no defined order")
    return Extracted(inputs, {"topk_indices": torch.tensor(picks, dtype=torch.int32)},
                     notes + _INDEXER_NOTES)


def _define_sparse(call: ProbeCall) -> Definition | None:
    module = call.instance
    indexer = getattr(module, "indexer", None)
    if indexer is None or call.args.get("past_key_values") is None:
        return None
    return instantiate("dsa_sparse_mla", num_qo_heads=int(module.num_heads),
                       head_dim_ckv=int(module.kv_lora_rank),
                       head_dim_kpe=int(module.qk_rope_head_dim),
                       topk=int(indexer.index_topk), page_size=PAGE_SIZE)


def _index_scores(indexer: Any, q: torch.Tensor, keys: torch.Tensor, hidden: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
    """``[B, S, T]``: the indexer's masked scores, op for op as its forward computes them."""
    scores = torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1))
    scores = torch.relu(scores * indexer.softmax_scale)
    weights = _indexer_weights(indexer, hidden)
    index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    return (index_scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool
            else index_scores + mask)


def _indexer_choice(module: Any, call: ProbeCall, mask: torch.Tensor) -> torch.Tensor:
    """``[B, S, k]``: the indexer's choice, recomputed as its forward computes it."""
    a, indexer = call.args, module.indexer
    q_resid = rms_norm_as_engine(module.q_a_layernorm, module.q_a_proj(a["hidden_states"]))
    q = _indexer_query(indexer, q_resid, a["position_embeddings"])
    keys = a["past_key_values"].layers[module.layer_idx].indexer_keys
    index_scores = _index_scores(indexer, q, keys, a["hidden_states"], mask)
    k = min(indexer.index_topk, index_scores.shape[-1])
    return index_scores.topk(k, dim=-1).indices


def _boundary_ties(scores: torch.Tensor, topk: int) -> int:
    """Tokens whose k-th and (k+1)-th best finite scores are equal (``scores [N, T]``)."""
    if scores.shape[-1] <= topk:
        return 0
    best = scores.topk(topk + 1, dim=-1).values
    tied = (best[:, topk - 1] == best[:, topk]) & torch.isfinite(best[:, topk])
    return int(tied.sum())


_SPARSE_NOTES = [
    PAD_NOTE,
    "ckv_cache/kpe_cache: the layer's cached latents, each request's live columns packed "
    f"into fresh {PAGE_SIZE}-token pages in request order",
    "sparse_indices: the indexer's choice (recomputed op for op from its key cache after the "
    "call), restricted to visible keys, as page*page_size+offset; -1 pads",
    "q_pe recomputed with the layer's own ops; q_nope absorbed through W_UK in float32, "
    "rounded to bf16 (the engine runs MLA un-absorbed)",
    "outputs: none stored; the engine never forms the latent-space output or lse"]


def _adapt_sparse(call: ProbeCall) -> Extracted | None:
    module, a = call.instance, call.args
    mask = a["attention_mask"]
    ckv_all, kpe_all = latent_cache(call)
    requests = batch_requests(call)
    found = None if mask is None else _live(requests, mask, ckv_all.shape[1])
    if found is None:
        return None
    lives, seens = found
    choice = _indexer_choice(module, call, mask[:, 0])
    _, q_nope, q_pe = absorbed_query(module, a["hidden_states"], a["position_embeddings"])
    pages = pack_pages([len(c) for c in lives], PAGE_SIZE)
    tokens, indices, picked = [], [], []
    for j, (r, live, seen) in enumerate(zip(requests, lives, seens)):
        row_of = {c: int(pages.indptr[j]) * PAGE_SIZE + i for i, c in enumerate(live)}
        for i, column in enumerate(r.columns):
            chosen = [c for c in choice[r.batch_row, column].tolist() if bool(seen[i, c])]
            picked.append((r.batch_row, chosen))
            tokens.append((r.batch_row, column))
            indices.append(_picks_as_rows(chosen, seen[i], row_of, module.indexer.index_topk))
    qn = torch.stack([q_nope[b, :, c] for b, c in tokens])
    qp = torch.stack([q_pe[b, :, c] for b, c in tokens])
    error = check_against_engine(module, [call.result[0][b, c] for b, c in tokens], qn, qp,
                                 [ckv_all[b, cs] for b, cs in picked],
                                 [kpe_all[b, cs] for b, cs in picked])
    inputs = {"q_nope": qn, "q_pe": qp,
              "ckv_cache": fill_pages([ckv_all[r.batch_row, c] for r, c in zip(requests, lives)],
                                      PAGE_SIZE),
              "kpe_cache": fill_pages([kpe_all[r.batch_row, c] for r, c in zip(requests, lives)],
                                      PAGE_SIZE),
              "sparse_indices": torch.tensor(indices, dtype=torch.int32),
              "sm_scale": float(module.scaling)}
    return Extracted(inputs, {}, [*_SPARSE_NOTES, f"checked: reference math on these inputs, "
                                  "through W_UV and o_proj, gives the layer's real output "
                                  f"within relative error {error:.2e}"])


DSA_PROBES: list[Probe] = [
    Probe("hf.dsa.indexer", "dsa_indexer_topk", _define_indexer, _adapt_indexer,
          suffix="V32Indexer", description="DeepseekV32Indexer.forward (lightning indexer)"),
    Probe("hf.dsa.sparse_mla", "dsa_sparse_mla", _define_sparse, _adapt_sparse,
          suffix="V32Attention", description="DeepseekV32Attention.forward (sparse MLA; "
          "inputs reconstructed in the absorbed form)"),
]
