"""GQA attention at SGLang's ``RadixAttention.forward(q, k, v, forward_batch,
save_kv_cache=True)`` (``srt/layers/radix_attention.py``): extend (a prefill over the
request's cached prefix and its new tokens) and decode (one token over the paged cache).

``RadixAttention`` hands the call to whichever attention backend the engine runs
(torch-native here, FlashInfer/Triton/FA3 on CUDA), so the probe holds on every device.
The backend writes the step's keys and values into SGLang's token pool before it attends:
after the call, each request's keys and values are read back from the pool at its slots
(``req_to_token[req_pool_index, :seq_len]``), so the workload holds exactly what the
kernel read. SGLang's pool is flat (one token per slot): for the paged decode definition
the request's slots are compacted into pages of one token, renumbered in order.
Plain causal attention only (no logit cap, sliding window, cross attention); TP=1.

MLA (DeepSeek-V3) calls the same ``RadixAttention`` in its absorbed form: the query is
``[q_nope (kv_lora_rank), q_pe (rope)]`` per head, one latent key head ``[ckv, kpe]`` and
the latent ``ckv`` as the value (head dims 576 / 512). On decode that is the
``mla_paged_decode`` definition, the latent cache read back from the pool split into
``ckv`` and ``kpe``; SGLang's fused-rope form (``q_rope``/``k_rope`` keyword arguments,
the AMX path) and the absorbed extend are not captured.
"""

from __future__ import annotations

from typing import Any

import torch

from enginetap.capture.probe import Extracted, Probe, ProbeCall
from enginetap.dataset.schema import Definition
from enginetap.engines.sglang.probes.common import (DTYPES, current_runner, instantiate,
                                                   single_rank)

__all__ = ["ATTENTION_PROBES", "ATTENTION_TARGETS"]

FORWARD = "sglang.srt.layers.radix_attention:RadixAttention.forward"
ATTENTION_TARGETS = (FORWARD,
                     "sglang.srt.layers.attention.torch_native_backend:"
                     "TorchNativeAttnBackend.forward_extend",
                     "sglang.srt.layers.attention.torch_native_backend:"
                     "TorchNativeAttnBackend.forward_decode",
                     "sglang.srt.layers.attention.torch_native_backend:"
                     "TorchNativeAttnBackend._run_sdpa_forward_extend")


def _plain(call: ProbeCall) -> bool:
    layer, args = call.instance, call.args
    kwargs = args.get("kwargs") or {}
    return (not (layer.logit_cap and layer.logit_cap > 0) and layer.sliding_window_size == -1
            and not layer.is_cross_attention and layer.qk_head_dim == layer.v_head_dim
            and "k_rope" not in kwargs and args.get("save_kv_cache", True)
            and args.get("k") is not None and call.step.world_size == 1
            and DTYPES.get(args["q"].dtype) is not None)


def _mla(call: ProbeCall) -> bool:
    """The absorbed MLA form: one latent key head whose first ``v_head_dim`` are the value."""
    layer, args = call.instance, call.args
    kwargs = args.get("kwargs") or {}
    return (int(layer.tp_k_head_num) == 1 and layer.qk_head_dim > layer.v_head_dim
            and "k_rope" not in kwargs and "q_rope" not in kwargs
            and "topk_indices" not in kwargs and args.get("save_kv_cache", True)
            and args.get("k") is not None and call.step.world_size == 1
            and DTYPES.get(args["q"].dtype) is not None
            and not (layer.logit_cap and layer.logit_cap > 0))


def _extend(batch: Any) -> bool:
    return batch.forward_mode.is_extend() and not batch.forward_mode.is_target_verify()


def _mla_definition(call: ProbeCall, name: str) -> Definition:
    layer = call.instance
    return instantiate(name, num_qo_heads=int(layer.tp_q_head_num),
                       head_dim_ckv=int(layer.v_head_dim),
                       head_dim_kpe=int(layer.qk_head_dim - layer.v_head_dim), page_size=1,
                       dtype=DTYPES[call.args["q"].dtype])


def _define_mla_decode(call: ProbeCall) -> Definition | None:
    if not call.args["forward_batch"].forward_mode.is_decode() or not _mla(call):
        return None
    return _mla_definition(call, "mla_paged_decode")


def _define_mla_extend(call: ProbeCall) -> Definition | None:
    if not _extend(call.args["forward_batch"]) or not _mla(call) \
            or call.instance.is_cross_attention:
        return None
    return _mla_definition(call, "mla_paged_prefill")


def _one_token_pages(lens: list[int]) -> dict[str, torch.Tensor]:
    """The requests' slots as pages of one token, compacted and renumbered in order."""
    return {"kv_indptr": _indptr(lens),
            "kv_indices": torch.arange(sum(lens), dtype=torch.int32),
            "kv_last_page_len": torch.ones(len(lens), dtype=torch.int32)}


def _indptr(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)


def _mla_call(call: ProbeCall) -> tuple[dict[str, Any], list[int], torch.Tensor]:
    """The absorbed query and the requests' latent cache split into ckv and kpe, the
    requests' sequence lengths, and the output ``[tokens, heads, ckv]``."""
    single_rank(call)
    layer = call.instance
    slots, lens = _request_slots(call)
    latent, _ = _pool(call)
    ckv = int(layer.v_head_dim)
    q, out = _q_out(call)
    every = torch.cat(slots)
    cache = latent[every].reshape(len(every), 1, layer.qk_head_dim)
    return ({"q_nope": q[..., :ckv].contiguous(), "q_pe": q[..., ckv:].contiguous(),
             "ckv_cache": cache[..., :ckv].contiguous(),
             "kpe_cache": cache[..., ckv:].contiguous()}, lens, out)


def _mla_split_note(call: ProbeCall) -> str:
    layer = call.instance
    ckv = int(layer.v_head_dim)
    return f"each split into ckv ({ckv}) and kpe ({layer.qk_head_dim - ckv})"


def _adapt_mla_decode(call: ProbeCall) -> Extracted:
    tensors, lens, out = _mla_call(call)
    inputs = {**tensors, **_one_token_pages(lens), "sm_scale": float(call.instance.scaling)}
    notes = [f"SGLang's latent pool as pages of one token: the requests' {sum(lens)} slots "
             f"compacted and renumbered 0..n-1 in request order, {_mla_split_note(call)}",
             "q split the same way (absorbed: q_nope already multiplied by W_UK)",
             "the backend returns no lse"]
    return Extracted(inputs, {"output": out}, notes)


def _adapt_mla_extend(call: ProbeCall) -> Extracted:
    batch = call.args["forward_batch"]
    tensors, lens, out = _mla_call(call)
    q_lens = [int(x) for x in batch.extend_seq_lens_cpu]
    inputs = {**tensors, "qo_indptr": _indptr(q_lens), **_one_token_pages(lens),
              "sm_scale": float(call.instance.scaling)}
    notes = [f"SGLang's latent pool as pages of one token, read back after the call: the "
             f"requests' {sum(lens)} slots (req_to_token[:seq_len]: cached prefix then this "
             f"step's tokens) compacted and renumbered 0..n-1 in request order, "
             f"{_mla_split_note(call)}",
             "q split the same way (absorbed: q_nope already multiplied by W_UK)",
             "the backend returns no lse"] + _prefix_note(batch)
    return Extracted(inputs, {"output": out}, notes)


def _prefix_note(batch: Any) -> list[str]:
    if any(p for p in batch.extend_prefix_lens_cpu):
        return [f"cached prefix per request: {list(batch.extend_prefix_lens_cpu)}"]
    return []


def _heads(layer: Any) -> dict[str, int]:
    return {"num_qo_heads": int(layer.tp_q_head_num), "num_kv_heads": int(layer.tp_k_head_num),
            "head_dim": int(layer.qk_head_dim)}


def _define_extend(call: ProbeCall) -> Definition | None:
    if not _extend(call.args["forward_batch"]) or not _plain(call):
        return None
    return instantiate("gqa_ragged_prefill", **_heads(call.instance),
                       dtype=DTYPES[call.args["q"].dtype])


def _define_decode(call: ProbeCall) -> Definition | None:
    if not call.args["forward_batch"].forward_mode.is_decode() or not _plain(call):
        return None
    return instantiate("gqa_paged_decode", **_heads(call.instance), page_size=1,
                       dtype=DTYPES[call.args["q"].dtype])


def _request_slots(call: ProbeCall) -> tuple[list[torch.Tensor], list[int]]:
    """Each request's KV slots (prefix and this step's tokens) and its sequence length."""
    batch = call.args["forward_batch"]
    table = current_runner().req_to_token_pool.req_to_token
    lens = [int(x) for x in (batch.seq_lens_cpu if batch.seq_lens_cpu is not None
                             else batch.seq_lens).tolist()]
    rows = batch.req_pool_indices.tolist()
    return [table[int(r), :n].to(torch.long) for r, n in zip(rows, lens)], lens


def _pool(call: ProbeCall) -> tuple[torch.Tensor, torch.Tensor]:
    pool = current_runner().token_to_kv_pool
    layer_id = call.instance.layer_id
    return pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)


def _q_out(call: ProbeCall) -> tuple[torch.Tensor, torch.Tensor]:
    layer = call.instance
    q = call.args["q"].reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
    out = call.result[0] if isinstance(call.result, tuple) else call.result
    return q, out.reshape(-1, layer.tp_q_head_num, layer.v_head_dim)


def _adapt_extend(call: ProbeCall) -> Extracted:
    single_rank(call)
    batch = call.args["forward_batch"]
    slots, lens = _request_slots(call)
    keys, values = _pool(call)
    q, output = _q_out(call)
    q_lens = [int(x) for x in batch.extend_seq_lens_cpu]
    every = torch.cat(slots)
    inputs = {"q": q, "k": keys[every], "v": values[every], "qo_indptr": _indptr(q_lens),
              "kv_indptr": _indptr(lens), "sm_scale": float(call.instance.scaling)}
    notes = ["k/v read back from SGLang's token pool after the call, at each request's slots "
             "(req_to_token[:seq_len]: cached prefix then this step's tokens)",
             "the backend returns no lse"] + _prefix_note(batch)
    return Extracted(inputs, {"output": output}, notes)


def _adapt_decode(call: ProbeCall) -> Extracted:
    single_rank(call)
    slots, lens = _request_slots(call)
    keys, values = _pool(call)
    q, output = _q_out(call)
    every = torch.cat(slots)
    inputs = {"q": q, "k_cache": keys[every].unsqueeze(1), "v_cache": values[every].unsqueeze(1),
              **_one_token_pages(lens), "sm_scale": float(call.instance.scaling)}
    notes = [f"SGLang's flat token pool as pages of one token: the requests' {len(every)} "
             "slots compacted and renumbered 0..n-1 in request order",
             "the backend returns no lse"]
    return Extracted(inputs, {"output": output}, notes)



def _probe(name: str, family: str, define: Any, adapt: Any, when: str, what: str) -> Probe:
    return Probe(f"sglang.{name}", family, define, adapt, target=FORWARD, when=when,
                 description=f"RadixAttention.forward{what}")


ATTENTION_PROBES = [
    _probe("attention.extend", "gqa_ragged_prefill", _define_extend, _adapt_extend, "prefill",
           " on an extend batch (radix_attention.py)"),
    _probe("attention.decode", "gqa_paged_decode", _define_decode, _adapt_decode, "decode",
           " on a decode batch (radix_attention.py)"),
    _probe("mla.decode", "mla_paged_decode", _define_mla_decode, _adapt_mla_decode, "decode",
           ", MLA absorbed decode (DeepSeek's attn_mqa)"),
    _probe("mla.extend", "mla_paged_prefill", _define_mla_extend, _adapt_mla_extend, "prefill",
           ", MLA absorbed extend (DeepSeek's attn_mqa)"),
]
