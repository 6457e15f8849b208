"""GQA ragged prefill and paged decode: ``CPUAttentionBackendImpl.forward``.

The kernel writes its result into the ``output`` argument, read after the call. Its KV
cache is packed per ISA (:mod:`.packing`), so the adapters unpack the pages the captured
requests read into FlashInfer's NHD layout, compacted to those live pages (renumbered,
the original physical ids noted). Prefill's ``k``/``v`` are each request's whole key/value
history read back from the cache after the call (cached prefix included); decode keeps the
compacted cache itself. Under TP the heads are sharded: q, output and the caches are
gathered along their head dimension on rank 0.
"""

from __future__ import annotations

from typing import Any

import torch

from enginetap.capture.probe import Extracted, Probe, ProbeCall
from enginetap.dataset.schema import Definition
from enginetap.engines.vllm.probes.common import (DTYPES, Pages, compact_pages, gather,
                                                   instantiate, other_rank, tp_world)
from enginetap.engines.vllm.probes.packing import kv_unpacker, unpack

__all__ = ["ATTENTION_PROBES", "ATTENTION_TARGETS"]

TARGET = "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.forward"
ATTENTION_TARGETS = (TARGET, "vllm._custom_ops:cpu_attn_reshape_and_cache")


def _plain_causal(call: ProbeCall) -> bool:
    impl, meta, cache = call.instance, call.args.get("attn_metadata"), call.args["kv_cache"]
    return (meta is not None and bool(meta.causal) and meta.dynamic_causal is None
            and getattr(meta, "encoder_cache", None) is None
            and impl.alibi_slopes is None and impl.sinks is None
            and getattr(impl, "sliding_window", -1) in (None, -1)
            and not impl.logits_soft_cap and cache.dtype == call.args["query"].dtype
            and call.args.get("output_scale") is None)


def _q_lens(meta: Any) -> list[int]:
    starts = meta.query_start_loc.cpu().tolist()
    return [b - a for a, b in zip(starts, starts[1:])]


def _heads(call: ProbeCall) -> dict[str, int]:
    query, cache = call.args["query"], call.args["kv_cache"]
    world = tp_world(call)
    return {"num_qo_heads": int(query.shape[1]) * world,
            "num_kv_heads": int(cache.shape[1]) * world, "head_dim": int(query.shape[2])}


def _define_prefill(call: ProbeCall) -> Definition | None:
    query = call.args["query"]
    if query.dim() != 3 or DTYPES.get(query.dtype) is None or not _plain_causal(call):
        return None
    return instantiate("gqa_ragged_prefill", **_heads(call), dtype=DTYPES[query.dtype])


def _define_decode(call: ProbeCall) -> Definition | None:
    query = call.args["query"]
    if (call.step.mode != "decode" or query.dim() != 3 or DTYPES.get(query.dtype) is None
            or not _plain_causal(call) or set(_q_lens(call.args["attn_metadata"])) != {1}):
        return None
    return instantiate("gqa_paged_decode", **_heads(call), page_size=int(
        call.args["kv_cache"].shape[2]), dtype=DTYPES[query.dtype])


def _unpacked(call: ProbeCall, pages: Pages) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's compacted key and value pages, NHD ``[pages, page_size, heads, dim]``."""
    cache = call.args["kv_cache"]
    blocks, heads, block_size, width = cache.shape
    halves = cache.view(blocks, heads, 2 * block_size, width // 2).chunk(2, dim=2)
    index = torch.tensor(pages.physical, dtype=torch.long)
    isa = call.args["layer"].isa
    out = []
    for half, which in zip(halves, ("key", "value")):
        perm = kv_unpacker(isa, heads, block_size, width // 2, cache.dtype, which)
        out.append(unpack(half[index], perm, (block_size, heads, width // 2)))
    return out[0], out[1]


def _tokens(call: ProbeCall) -> tuple[torch.Tensor, torch.Tensor]:
    meta, query = call.args["attn_metadata"], call.args["query"]
    count = int(meta.num_actual_tokens)
    output = call.args["output"][:count].reshape(count, query.shape[1], query.shape[2])
    return query[:count], output


def _adapt_prefill(call: ProbeCall) -> Extracted:
    meta = call.args["attn_metadata"]
    block_size = int(call.args["kv_cache"].shape[2])
    pages = compact_pages(meta.block_table, meta.seq_lens, block_size)
    k_pages, v_pages = _unpacked(call, pages)
    keys, values = _request_tokens(k_pages, pages), _request_tokens(v_pages, pages)
    q, output = _tokens(call)
    parts = [gather(call, t, 1) for t in (q, output, keys, values)]
    if parts[0] is None:
        return other_rank()
    q, output, keys, values = parts
    seq_lens = [int(x) for x in meta.seq_lens.cpu().tolist()]
    kv_indptr = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32)
    inputs = {"q": q, "k": keys, "v": values, "qo_indptr": meta.query_start_loc.to(torch.int32),
              "kv_indptr": kv_indptr, "sm_scale": float(call.instance.scale)}
    notes = [pages.note("k/v read back from the ISA-packed KV cache after the call"),
             "k/v are each request's whole cached history (prefix included), in request order",
             "output read from the kernel's `output` argument after the call; the kernel "
             "returns no lse"]
    return Extracted(inputs, {"output": output}, notes + _tp_note(call))


def _request_tokens(pages_nhd: torch.Tensor, pages: Pages) -> torch.Tensor:
    """Every request's tokens, concatenated in request order: ``[total_kv, heads, dim]``."""
    indptr, indices = pages.indptr.tolist(), pages.indices.tolist()
    page_size = pages_nhd.shape[1]
    out = []
    for b in range(len(indptr) - 1):
        own = pages_nhd[indices[indptr[b]:indptr[b + 1]]].reshape(-1, *pages_nhd.shape[2:])
        length = (indptr[b + 1] - indptr[b] - 1) * page_size + int(pages.last_page_len[b])
        out.append(own[:max(length, 0)])
    return torch.cat(out, dim=0)


def _adapt_decode(call: ProbeCall) -> Extracted:
    meta = call.args["attn_metadata"]
    block_size = int(call.args["kv_cache"].shape[2])
    pages = compact_pages(meta.block_table, meta.seq_lens, block_size)
    k_pages, v_pages = _unpacked(call, pages)
    q, output = _tokens(call)
    parts = [gather(call, q, 1), gather(call, output, 1), gather(call, k_pages, 2),
             gather(call, v_pages, 2)]
    if parts[0] is None:
        return other_rank()
    q, output, k_cache, v_cache = parts
    inputs = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "kv_indptr": pages.indptr,
              "kv_indices": pages.indices, "kv_last_page_len": pages.last_page_len,
              "sm_scale": float(call.instance.scale)}
    notes = [pages.note("KV pages unpacked from the ISA-packed cache to NHD"),
             "output read from the kernel's `output` argument after the call; the kernel "
             "returns no lse"]
    return Extracted(inputs, {"output": output}, notes + _tp_note(call))


def _tp_note(call: ProbeCall) -> list[str]:
    world = tp_world(call)
    if world == 1:
        return []
    return [f"TP={world}: q, output and k/v heads gathered from every rank in rank order"]


ATTENTION_PROBES = [
    Probe("vllm.cpu_attn.prefill", "gqa_ragged_prefill", _define_prefill, _adapt_prefill,
          target=TARGET, when="prefill",
          description="CPUAttentionBackendImpl.forward on prefill and mixed steps"),
    Probe("vllm.cpu_attn.decode", "gqa_paged_decode", _define_decode, _adapt_decode,
          target=TARGET, when="decode",
          description="CPUAttentionBackendImpl.forward on decode steps"),
]
