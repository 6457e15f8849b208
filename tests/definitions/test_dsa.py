"""DSA families: the indexer against a per-(token, key) loop and transformers' DeepSeek-V3.2
indexer; sparse MLA against dense MLA under a mask built from the indices (float64)."""

from __future__ import annotations

import math

import torch

from enginetap.definitions import compile_reference, get_template


def reference(family: str, **values):
    defn = get_template(family).instantiate(**values)
    return defn, compile_reference(defn.reference, defn.name)


# --- indexer ----------------------------------------------------------------------------

INDEXER = {"index_n_heads": 4, "index_head_dim": 32, "index_topk": 12}


def indexer_loop(q, k, w, start, end, topk):
    """Score every visible (token, key) pair one at a time in float64; best first, ties
    to the lower key row; -1 after the visible keys."""
    rows = []
    for t in range(q.shape[0]):
        scores = {}
        for s in range(int(start[t]), int(end[t])):
            dots = q[t].double() @ k[s].double()
            scores[s] = float((w[t].double() * dots.clamp(min=0)).sum())
        best = sorted(scores, key=lambda s: (-scores[s], s))[:topk]
        rows.append(best + [-1] * (topk - len(best)))
    return torch.tensor(rows, dtype=torch.int32)


def test_indexer_matches_per_key_loop_on_generated_batches():
    template = get_template("dsa_indexer_topk")
    defn, run = reference("dsa_indexer_topk", **INDEXER)
    inputs = template.synthetic_inputs(defn, {"num_tokens": 30, "num_keys": 90}, seed=2)
    got, scores = run(**inputs)
    want = indexer_loop(inputs["q_index"], inputs["k_index"], inputs["weights"],
                        inputs["key_start"], inputs["key_end"], INDEXER["index_topk"])
    assert torch.equal(got, want)
    visible = inputs["key_end"] - inputs["key_start"]
    # The batch mixes sequences: some tokens see fewer keys than index_topk (-1 padding),
    # some see more; each -1 count is exactly the shortfall.
    assert (visible < INDEXER["index_topk"]).any() and (visible > INDEXER["index_topk"]).any()
    padding = (got == -1).sum(dim=-1)
    assert torch.equal(padding, (INDEXER["index_topk"] - visible).clamp(min=0))
    assert len(set(inputs["key_start"].tolist())) > 1


def test_indexer_ties_go_to_the_lower_key_row():
    _, run = reference("dsa_indexer_topk", index_n_heads=2, index_head_dim=4, index_topk=3)
    k = torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0], [1.0, 0, 0, 0], [1.0, 0, 0, 0],
                      [-1.0, 0, 0, 0]]).bfloat16()
    q = torch.tensor([[[1.0, 0, 0, 0], [0, 0, 1.0, 0]]]).bfloat16()
    w = torch.tensor([[0.5, 2.0]])
    # Rows 0, 2, 3 tie at 0.5 and row 1 scores 0; only rows 1..4 are visible, so row 1
    # (score 0) comes third after the tied rows 2 and 3.
    got, _ = run(q, k, w, torch.tensor([1], dtype=torch.int32), torch.tensor([5], dtype=torch.int32))
    assert got.tolist() == [[2, 3, 1]]


def test_indexer_matches_transformers_deepseek_v32():
    from transformers import DeepseekV32Config
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as dsv32

    # 16 heads: a key's score is exactly 0 (a tie) only if all 16 relus clip it.
    config = DeepseekV32Config(hidden_size=64, q_lora_rank=48, qk_rope_head_dim=16,
                               index_n_heads=16, index_head_dim=32, index_topk=12,
                               num_attention_heads=4, num_key_value_heads=4)
    torch.manual_seed(0)
    indexer = dsv32.DeepseekV32Indexer(config, layer_idx=0).to(torch.bfloat16)
    indexer.weights_proj.float()  # kept in float32 by the model, as in the checkpoints
    batch, seq = 2, 20
    hidden = torch.randn(batch, seq, 64).bfloat16()
    q_resid = torch.randn(batch, seq, 48).bfloat16()
    positions = torch.arange(seq).expand(batch, seq)
    cos, sin = dsv32.DeepseekV32RotaryEmbedding(config)(hidden, positions)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril().expand(batch, seq, seq)
    with torch.no_grad():
        theirs = indexer(hidden, q_resid, (cos, sin), causal, positions)
        q, k, weights = transformers_indexer_inputs(indexer, hidden, q_resid, cos, sin)
    rows = torch.arange(batch * seq)
    start = (rows // seq * seq).to(torch.int32)
    end = (rows + 1).to(torch.int32)
    _, run = reference("dsa_indexer_topk", index_n_heads=16, index_head_dim=32, index_topk=12)
    ours, _ = run(q.flatten(0, 1), k.flatten(0, 1), weights.flatten(0, 1), start, end)
    for t in range(batch * seq):
        visible = min(12, int(end[t] - start[t]))
        # transformers also returns masked keys (score -inf) when fewer are visible.
        want = {int(i) + int(start[t]) for i in theirs.flatten(0, 1)[t, :visible]}
        assert set(ours[t, :visible].tolist()) == want, t
        assert (ours[t, visible:] == -1).all()


def transformers_indexer_inputs(indexer, hidden, q_resid, cos, sin):
    """The indexer's own q, k and head weights, as the family defines them."""
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb

    batch, seq, _ = hidden.shape
    rope, dim, heads = indexer.qk_rope_head_dim, indexer.head_dim, indexer.n_heads
    q = indexer.wq_b(q_resid).view(batch, seq, heads, dim)
    q_rot, q_pass = q.split([rope, dim - rope], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)
    k_rot, k_pass = k.split([rope, dim - rope], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q, k = torch.cat([q_rot, q_pass], dim=-1), torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    weights = indexer.weights_proj(hidden.float()) * heads ** -0.5 * indexer.softmax_scale
    return q, k, weights


# --- sparse MLA -------------------------------------------------------------------------

SPARSE = {"num_qo_heads": 4, "head_dim_ckv": 512, "head_dim_kpe": 64, "topk": 24,
          "page_size": 4}


def dense_masked_mla(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale):
    """Attention over every cache row in float64, rows outside the indices masked out."""
    ckv = ckv_cache.flatten(0, 1).double()
    kpe = kpe_cache.flatten(0, 1).double()
    mask = torch.zeros(q_nope.shape[0], ckv.shape[0], dtype=torch.bool)
    for t, row in enumerate(sparse_indices.tolist()):
        mask[t, [i for i in row if i != -1]] = True
    logits = (torch.einsum("thd,kd->thk", q_nope.double(), ckv)
              + torch.einsum("thd,kd->thk", q_pe.double(), kpe)) * sm_scale
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    out = torch.einsum("thk,kd->thd", torch.softmax(logits, dim=-1), ckv)
    return out, torch.logsumexp(logits, dim=-1) / math.log(2.0)


def test_sparse_mla_matches_dense_masked_attention():
    template = get_template("dsa_sparse_mla")
    defn, run = reference("dsa_sparse_mla", **SPARSE)
    inputs = template.synthetic_inputs(defn, {"num_tokens": 10, "num_pages": 16}, seed=4)
    valid = inputs["sparse_indices"] != -1
    # Padding present, full rows present, valid rows distinct per token.
    assert (~valid).any() and valid.all(dim=-1).any()
    for row in inputs["sparse_indices"].tolist():
        kept = [i for i in row if i != -1]
        assert len(kept) == len(set(kept)) and max(kept) < 16 * 4
    out, lse = run(**inputs)
    want_out, want_lse = dense_masked_mla(**inputs)
    torch.testing.assert_close(out.double(), want_out, atol=1e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    # The indices matter: attending to every row instead gives another answer.
    full = torch.arange(64, dtype=torch.int32).expand(10, 64)
    dense_out, _ = dense_masked_mla(**{**inputs, "sparse_indices": full})
    assert not torch.allclose(out.double(), dense_out, atol=1e-2, rtol=2e-2)


def test_sparse_mla_row_without_indices_gives_zeros():
    template = get_template("dsa_sparse_mla")
    defn, run = reference("dsa_sparse_mla", **SPARSE)
    inputs = template.synthetic_inputs(defn, {"num_tokens": 3, "num_pages": 8}, seed=1)
    inputs["sparse_indices"][1] = -1
    out, lse = run(**inputs)
    assert not out[1].any() and torch.isneginf(lse[1]).all()
    assert out[0].any() and torch.isfinite(lse[0]).all() and not out.isnan().any()
