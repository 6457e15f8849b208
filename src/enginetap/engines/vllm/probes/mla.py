"""MLA paged decode (DeepSeek-V3): ``forward_mqa`` of vLLM CPU's two MLA backends.

Where the CPU has AMX, vLLM runs ``AMXMLAImpl`` (``amx_mla.py``); elsewhere ``CPUMLAImpl``
(``cpu_mla.py``). Both take the absorbed query (one tensor ``[B, H, ckv + kpe]`` or a
``(q_nope, q_pe)`` pair) and a token-major latent cache ``[blocks, block_size, ckv + kpe]``
and return ``(output, None)``; both are probed and whichever the machine runs fires. The
cache is compacted to the captured requests' live pages. Heads are sharded under TP (the
latent cache is replicated): q and output are gathered along heads on rank 0.

MLA prefill is not captured: vLLM CPU runs it un-absorbed through ``forward_mha`` (with
the up-projections inside), and no definition family describes that form yet.
"""

from __future__ import annotations

from typing import Any

import torch

from enginetap.capture.probe import Extracted, Probe, ProbeCall
from enginetap.dataset.schema import Definition
from enginetap.engines.vllm.probes.common import (DTYPES, compact_pages, gather, instantiate,
                                                   is_writer, other_rank, tp_world)

__all__ = ["MLA_PROBES", "MLA_TARGETS"]

_BACKENDS = "vllm.v1.attention.backends.mla"
CPU_MLA = f"{_BACKENDS}.cpu_mla:CPUMLAImpl.forward_mqa"
AMX_MLA = f"{_BACKENDS}.amx_mla:AMXMLAImpl.forward_mqa"
MLA_TARGETS = (CPU_MLA, AMX_MLA, f"{_BACKENDS}.cpu_mla:CPUMLAImpl.do_kv_cache_update",
               f"{_BACKENDS}.amx_mla:AMXMLAImpl.do_kv_cache_update")


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
