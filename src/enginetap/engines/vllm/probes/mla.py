"""MLA paged decode (DeepSeek-V3): ``forward_mqa`` of vLLM CPU's two MLA backends.

Where the CPU has AMX, vLLM runs ``AMXMLAImpl`` (``amx_mla.py``); elsewhere ``CPUMLAImpl``
(``cpu_mla.py``). Both take the absorbed query (one tensor ``[B, H, ckv + kpe]`` or a
``(q_nope, q_pe)`` pair) and a token-major latent cache ``[blocks, block_size, ckv + kpe]``
and return ``(output, None)``; both are probed and whichever the machine runs fires. The
cache is compacted to the captured requests' live pages. Heads are sharded under TP (the
latent cache is replicated): q and output are gathered along heads on rank 0.

MLA prefill (``mla_paged_prefill``): on AMX machines ``AMXMLAImpl.forward_mha`` absorbs
W_UK into the query and calls ``vllm._custom_ops.cpu_mla_extend``, which attends each
request's cached prefix (rows of the flat latent cache named by ``req_to_token``) and its
new tokens (``k_extend``) and writes the latent output into ``o_extend``; the probe wraps
that call. Prefix and new tokens are laid out into fresh pages, in token order. Without
AMX, ``CPUMLAImpl`` runs prefill un-absorbed with the up-projections inside: not captured.
"""

from __future__ import annotations

from typing import Any

import torch

from enginetap.capture.probe import Extracted, Probe, ProbeCall
from enginetap.dataset.schema import Definition
from enginetap.engines.vllm.probes.common import (DTYPES, compact_pages, gather, instantiate,
                                                   is_writer, other_rank, tp_world)

__all__ = ["MLA_PREFILL_PROBES", "MLA_PREFILL_TARGETS", "MLA_PROBES", "MLA_TARGETS"]

_BACKENDS = "vllm.v1.attention.backends.mla"
CPU_MLA = f"{_BACKENDS}.cpu_mla:CPUMLAImpl.forward_mqa"
AMX_MLA = f"{_BACKENDS}.amx_mla:AMXMLAImpl.forward_mqa"
MLA_TARGETS = (CPU_MLA, AMX_MLA, f"{_BACKENDS}.cpu_mla:CPUMLAImpl.do_kv_cache_update",
               f"{_BACKENDS}.amx_mla:AMXMLAImpl.do_kv_cache_update")
EXTEND = "vllm._custom_ops:cpu_mla_extend"
MLA_PREFILL_TARGETS = (EXTEND, f"{_BACKENDS}.amx_mla:AMXMLAImpl.forward_mha")
PREFILL_PAGE = 16
"""Page size of the pages a captured prefill's tokens are laid into (the engine's latent
cache is flat, one token per row)."""


def _query(call: ProbeCall) -> torch.Tensor:
    q = call.args["q"]
    return torch.cat(q, dim=-1) if isinstance(q, tuple) else q


def _define(call: ProbeCall) -> Definition | None:
    impl, q, cache = call.instance, _query(call), call.args["kv_c_and_k_pe_cache"]
    decode = getattr(call.args["attn_metadata"], "decode", None)
    ckv = int(impl.kv_lora_rank)
    dtype = DTYPES.get(q.dtype)
    if (decode is None or dtype is None or cache.dtype != q.dtype or q.dim() != 3
            or q.shape[0] != decode.seq_lens.shape[0] or cache.shape[-1] != q.shape[-1]):
        return None
    return instantiate("mla_paged_decode", num_qo_heads=int(q.shape[1]) * tp_world(call),
                       head_dim_ckv=ckv, head_dim_kpe=int(q.shape[-1]) - ckv,
                       page_size=int(cache.shape[1]), dtype=dtype)


def _adapt(call: ProbeCall) -> Extracted:
    impl, q = call.instance, _query(call)
    output = call.result[0] if isinstance(call.result, tuple) else call.result
    q_all, out_all = gather(call, q, 1), gather(call, output, 1)
    if not is_writer(call) or q_all is None or out_all is None:
        return other_rank()
    decode = call.args["attn_metadata"].decode
    cache = call.args["kv_c_and_k_pe_cache"]
    page_size, ckv = int(cache.shape[1]), int(impl.kv_lora_rank)
    pages = compact_pages(decode.block_table, decode.seq_lens, page_size)
    live = cache.reshape(cache.shape[0], page_size, -1)[torch.tensor(pages.physical,
                                                                     dtype=torch.long)]
    inputs: dict[str, Any] = {
        "q_nope": q_all[..., :ckv].contiguous(), "q_pe": q_all[..., ckv:].contiguous(),
        "ckv_cache": live[..., :ckv].contiguous(), "kpe_cache": live[..., ckv:].contiguous(),
        "kv_indptr": pages.indptr, "kv_indices": pages.indices,
        "kv_last_page_len": pages.last_page_len, "sm_scale": float(impl.scale)}
    notes = [pages.note("latent cache"),
             f"{type(impl).__name__}.forward_mqa ran; its absorbed query split at "
             f"kv_lora_rank={ckv} into q_nope / q_pe, the cache into ckv / kpe",
             "the kernel returns no lse"]
    if tp_world(call) > 1:
        notes.append(f"TP={tp_world(call)}: query heads and output gathered in rank order; "
                     "the latent cache is replicated, rank 0's is used")
    return Extracted(inputs, {"output": out_all}, notes)


MLA_PROBES = [
    Probe(f"vllm.mla.{name}", "mla_paged_decode", _define, _adapt, target=target,
          when="decode", description=f"{target} (absorbed decode)")
    for name, target in (("cpu", CPU_MLA), ("amx", AMX_MLA))
]


def _define_prefill(call: ProbeCall) -> Definition | None:
    args = call.args
    q, k_extend, buffer = args["q_extend"], args["k_extend"], args["k_buffer"]
    values = args.get("v_buffer")
    dtype = DTYPES.get(q.dtype)
    if (dtype is None or k_extend is None or q.dim() != 3 or buffer.dtype != q.dtype
            or args["is_cross_attn"] or args["sliding_window_size"] > 0
            or args["logit_cap"] or args["sinks"] is not None
            or args.get("tree_mask") is not None or values is None):
        return None
    ckv = int(values.shape[-1])
    if buffer.shape[-1] != q.shape[-1] or k_extend.shape[-1] != q.shape[-1]:
        return None
    return instantiate("mla_paged_prefill", num_qo_heads=int(q.shape[1]) * tp_world(call),
                       head_dim_ckv=ckv, head_dim_kpe=int(q.shape[-1]) - ckv,
                       page_size=PREFILL_PAGE, dtype=dtype)


def _prefill_tokens(args: dict[str, Any]) -> tuple[list[torch.Tensor], list[int], list[int]]:
    """Per request its latent tokens in order (cached prefix rows, then new tokens), and
    its query and prefix lengths."""
    table, pool = args["req_to_token"], args["req_pool_indices"].tolist()
    seq, ext = args["seq_lens"].tolist(), args["extend_seq_lens"].tolist()
    starts = args["extend_start_loc"].tolist()
    flat = args["k_buffer"].reshape(-1, args["k_buffer"].shape[-1])
    new = args["k_extend"].reshape(-1, args["k_extend"].shape[-1])
    tokens, prefixes = [], []
    for b, (row, total, n, start) in enumerate(zip(pool, seq, ext, starts)):
        prefix = int(total) - int(n)
        slots = table[row, :prefix].to(torch.long)
        tokens.append(torch.cat([flat[slots], new[start:start + n]]))
        prefixes.append(prefix)
    return tokens, [int(n) for n in ext], prefixes


def _paged(tokens: list[torch.Tensor], ckv: int) -> dict[str, torch.Tensor]:
    counts = [-(-t.shape[0] // PREFILL_PAGE) for t in tokens]
    width = tokens[0].shape[-1]
    cache = tokens[0].new_zeros((sum(counts) * PREFILL_PAGE, width))
    start = 0
    for t, c in zip(tokens, counts):
        cache[start:start + t.shape[0]] = t
        start += c * PREFILL_PAGE
    cache = cache.view(sum(counts), PREFILL_PAGE, width)
    as_int = {"dtype": torch.int32}
    indptr = torch.zeros(len(counts) + 1, **as_int)
    indptr[1:] = torch.tensor(counts, **as_int).cumsum(0)
    last = [t.shape[0] - (c - 1) * PREFILL_PAGE for t, c in zip(tokens, counts)]
    return {"ckv_cache": cache[..., :ckv].contiguous(), "kpe_cache": cache[..., ckv:].contiguous(),
            "kv_indptr": indptr, "kv_indices": torch.arange(int(indptr[-1]), **as_int),
            "kv_last_page_len": torch.tensor(last, **as_int)}


def _adapt_prefill(call: ProbeCall) -> Extracted:
    args = call.args
    q_all, out_all = gather(call, args["q_extend"], 1), gather(call, args["o_extend"], 1)
    if not is_writer(call) or q_all is None or out_all is None:
        return other_rank()
    ckv = int(args["v_buffer"].shape[-1])
    tokens, queries, prefixes = _prefill_tokens(args)
    qo = torch.zeros(len(queries) + 1, dtype=torch.int32)
    qo[1:] = torch.tensor(queries, dtype=torch.int32).cumsum(0)
    inputs: dict[str, Any] = {"q_nope": q_all[..., :ckv].contiguous(),
                              "q_pe": q_all[..., ckv:].contiguous(), "qo_indptr": qo,
                              **_paged(tokens, ckv), "sm_scale": float(args["sm_scale"])}
    notes = [f"cpu_mla_extend ran (AMXMLAImpl.forward_mha, W_UK absorbed): q_extend split at "
             f"kv_lora_rank={ckv} into q_nope / q_pe; o_extend is the output (no lse)",
             f"each request's cached prefix ({prefixes} tokens, rows of the flat latent cache "
             "at req_to_token) then its new tokens (k_extend), laid into fresh "
             f"{PREFILL_PAGE}-token pages numbered in request order; unused slots are zero"]
    if tp_world(call) > 1:
        notes.append(f"TP={tp_world(call)}: query heads and output gathered in rank order; "
                     "the latent cache is replicated, rank 0's is used")
    return Extracted(inputs, {"output": out_all}, notes)


MLA_PREFILL_PROBES = [
    Probe("vllm.mla.prefill", "mla_paged_prefill", _define_prefill, _adapt_prefill,
          target=EXTEND, when="prefill",
          description="vllm._custom_ops.cpu_mla_extend (AMX MLA prefill, absorbed)"),
]
