"""MLA decode probe of the built-in engine (DeepSeek-V3): what maps onto ``mla_paged_decode``.

transformers runs MLA un-absorbed on a dense cache: it caches the latent ``kv_nope`` (after
``kv_a_layernorm``) and ``k_rot`` (after RoPE) per token, then expands them with
``kv_b_proj`` into per-head keys and values for SDPA. The absorbed form of the definition
attends the latent cache directly, so:

- ``ckv_cache`` / ``kpe_cache``: the engine's own cached latents, read from the layer's
  cache after the call (exactly what it stored), packed into pages;
- ``q_pe``: the layer's rotary query, recomputed from the layer's input with the layer's
  own projections and RoPE function (the same ops on the same tensors);
- ``q_nope``: the non-rotary query absorbed into the latent space, ``q_pass @ W_UK[h]``
  with ``W_UK`` from ``kv_b_proj`` (float32, rounded once to bf16) — not an engine tensor;
- ``sm_scale``: the layer's ``scaling``.

The definition's output (attention in latent space, before ``W_UV``) and its lse are never
computed by the engine, so no output is stored: replay runs the reference on the captured
inputs without an engine comparison. What ties the inputs to the engine is a check the
adapter runs on every capture: the reference math on these inputs, projected through
``W_UV`` and ``o_proj``, must reproduce the layer's real output within bf16 rounding;
otherwise the probe fails loudly (never writes). The error found is in the notes.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from enginetap.capture.probe import Extracted, Probe, ProbeCall
from enginetap.dataset.schema import Definition
from enginetap.engines.hf.probes.attention import PAGE_SIZE
from enginetap.engines.hf.probes.common import (
    DTYPES,
    PAD_NOTE,
    batch_requests,
    column_ranges,
    fill_pages,
    instantiate,
    live_columns,
    pack_pages,
)

__all__ = ["MLA_PROBES", "TOLERANCE", "absorbed_query", "check_against_engine", "latent_cache",
           "rms_norm_as_engine"]

TOLERANCE = 0.01
"""Largest relative L2 error allowed between the layer's real output and the absorbed
reference math projected back: bf16 rounding of the engine's un-absorbed path gives about
3e-3 on the built-in model; inputs missing RoPE on q_pe give 4e-2."""


def _define(call: ProbeCall) -> Definition | None:
    module = call.instance
    hidden = call.args["hidden_states"]
    if (getattr(module, "kv_lora_rank", None) is None or hidden.dtype != torch.bfloat16
            or getattr(module, "q_lora_rank", None) is None or hidden.shape[1] != 1):
        return None
    return instantiate("mla_paged_decode", num_qo_heads=int(module.num_heads),
                       head_dim_ckv=int(module.kv_lora_rank),
                       head_dim_kpe=int(module.qk_rope_head_dim), page_size=PAGE_SIZE,
                       dtype=DTYPES[hidden.dtype])


def rms_norm_as_engine(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """transformers' DeepSeek RMSNorm, op for op (calling the module itself would run
    enginetap's own wrappers on it a second time)."""
    dtype = x.dtype
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * hidden.to(dtype)


def absorbed_query(module: Any, hidden: torch.Tensor,
                   position_embeddings: tuple[torch.Tensor, torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q_pass [B, H, S, nope], q_nope_absorbed [B, H, S, ckv] bf16, q_pe [B, H, S, rope])``
    recomputed from the layer's input with its own weights and RoPE function."""
    batch, seq = hidden.shape[:2]
    q_resid = rms_norm_as_engine(module.q_a_layernorm, module.q_a_proj(hidden))
    q = module.q_b_proj(q_resid).view(batch, seq, -1, module.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q, [module.qk_nope_head_dim, module.qk_rope_head_dim], dim=-1)
    code = sys.modules[type(module).__module__]
    cos, sin = position_embeddings
    # DeepSeek-V3.2's config has no rope_interleave: its attention always interleaves.
    rope = (code.apply_rotary_pos_emb_interleave
            if getattr(module.config, "rope_interleave", True) else code.apply_rotary_pos_emb)
    q_rot, _ = rope(q_rot, q_rot[:, :1], cos, sin)
    w_uk = _kv_b(module)[:, : module.qk_nope_head_dim]
    absorbed = torch.einsum("bhsd,hdc->bhsc", q_pass.float(), w_uk.float())
    return q_pass, absorbed.to(hidden.dtype), q_rot


def _kv_b(module: Any) -> torch.Tensor:
    """``kv_b_proj.weight`` as ``[heads, nope + v, kv_lora_rank]``."""
    return module.kv_b_proj.weight.view(module.num_heads, -1, module.kv_lora_rank)


def latent_cache(call: ProbeCall) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's cached ``(kv_nope [B, T, ckv], k_rot [B, T, rope])`` after the call."""
    layer = call.args["past_key_values"].layers[call.instance.layer_idx]
    return layer.keys[:, 0], layer.values[:, 0]


def check_against_engine(module: Any, engine: list[torch.Tensor], q_nope: torch.Tensor,
                         q_pe: torch.Tensor, ckv: list[torch.Tensor],
                         kpe: list[torch.Tensor]) -> float:
    """Largest relative L2 error, over query tokens, between the layer's real output
    (``engine[i]``, ``[hidden]``) and the absorbed math on query ``i``'s keys projected
    back through ``W_UV`` and ``o_proj``.

    Raises:
        ValueError: the error exceeds :data:`TOLERANCE` (the inputs are not the engine's).
    """
    w_uv = _kv_b(module)[:, module.qk_nope_head_dim:].float()
    worst = 0.0
    for i, real in enumerate(engine):
        c, p = ckv[i].float(), kpe[i].float()
        logits = (q_nope[i].float() @ c.T + q_pe[i].float() @ p.T) * module.scaling
        latent = torch.softmax(logits, dim=-1) @ c
        heads = torch.einsum("hc,hvc->hv", latent, w_uv).to(torch.bfloat16)
        mine = module.o_proj(heads.reshape(1, -1)).float()[0]
        real = real.float()
        worst = max(worst, float((mine - real).norm() / real.norm().clamp(min=1e-12)))
    if worst > TOLERANCE:
        raise ValueError(f"the absorbed MLA inputs do not reproduce the layer's output "
                         f"(relative error {worst:.3g} > {TOLERANCE})")
    return worst


def _adapt(call: ProbeCall) -> Extracted | None:
    module, a = call.instance, call.args
    requests = batch_requests(call)
    ckv_all, kpe_all = latent_cache(call)
    live, ok = live_columns(a["attention_mask"], False, requests, 1, ckv_all.shape[1])
    if not ok:
        return None
    rows = [r.batch_row for r in requests]
    _, q_nope, q_pe = absorbed_query(module, a["hidden_states"], a["position_embeddings"])
    q_nope, q_pe = q_nope[rows, :, 0], q_pe[rows, :, 0]
    ckv = [ckv_all[b, c] for b, c in zip(rows, live)]
    kpe = [kpe_all[b, c] for b, c in zip(rows, live)]
    engine = [call.result[0][b, 0] for b in rows]
    error = check_against_engine(module, engine, q_nope, q_pe, ckv, kpe)
    pages = pack_pages([len(c) for c in live], PAGE_SIZE)
    notes = [PAD_NOTE,
             "ckv_cache/kpe_cache: the layer's cached latents (kv_nope after kv_a_layernorm, "
             "k_rot after RoPE), compacted to each request's live columns and packed into "
             f"fresh {PAGE_SIZE}-token pages in request order",
             "q_pe: the rotary query recomputed from the layer input with the layer's own "
             "projections, RMSNorm (op for op) and RoPE",
             "q_nope: q_pass absorbed through W_UK (kv_b_proj) in float32, rounded to bf16: "
             "the engine runs MLA un-absorbed, this tensor is not the engine's",
             "outputs: none stored; the engine never forms the latent-space output or lse",
             f"checked: reference math on these inputs, through W_UV and o_proj, gives the "
             f"layer's real output within relative error {error:.2e}"]
    notes += [f"request {r.key}: cache columns {column_ranges(c)} of batch row {r.batch_row}"
              for r, c in zip(requests, live)]
    inputs = {"q_nope": q_nope, "q_pe": q_pe, "ckv_cache": fill_pages(ckv, PAGE_SIZE),
              "kpe_cache": fill_pages(kpe, PAGE_SIZE), "kv_indptr": pages.indptr,
              "kv_indices": pages.indices, "kv_last_page_len": pages.last_page_len,
              "sm_scale": float(module.scaling)}
    return Extracted(inputs, {}, notes)


MLA_PROBES: list[Probe] = [
    Probe("hf.mla.decode", "mla_paged_decode", _define, _adapt, suffix="DeepseekV3Attention",
          when="decode", description="DeepseekV3Attention.forward on decode steps "
          "(inputs reconstructed in the absorbed form; see the module docstring)"),
]
