"""Kernel-level tap points of SGLang (:meth:`SGLangHooks.tap_points`).

- ``Lk.attn.kv_written`` / ``Lk.attn.kv_prev``: after ``RadixAttention.forward`` (the
  attention backend wrote the step's keys and values into the token pool; the same
  wrapper records the layer's sublayer checkpoints, as for every sublayer), the key and
  value of each tapped row read back from its slot (``out_cache_loc``) of the layer's
  buffers, and those of the request's previous position (its slot from
  ``req_to_token_pool.req_to_token``). SGLang's pool is flat (``[slots, heads, dim]``;
  MLA keeps one latent buffer), so rows of any slot compare byte for byte.
- ``Lk.gdn.state_before`` / ``state_after`` and ``conv_before`` / ``conv_after``: around
  the gated-delta backend's ``forward_extend`` / ``forward_decode`` (one call per
  gated-delta layer and step), the recurrent and convolution state of each tapped
  request's slot, which the kernels update in place.
- the sampler: the next-token logits ``LogitsProcessor.forward`` returns (one row per
  request, in the batch's order) of each tapped row's request.

Points are only recorded inside a published step; speculative decoding is not tapped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from enginetap.core.patching import bind_arguments
from enginetap.core.scope import SCOPE
from enginetap.engines.sglang.runner import current_runner
from enginetap.engines.tapping import StateCall, logits_wrapper, state_wrapper
from enginetap.tap.record import TapRecorder
from enginetap.tap.record.rows import FlatBatch

__all__ = ["ATTENTION", "GDN_DECODE", "GDN_EXTEND", "LOGITS", "tap_points"]

ATTENTION = "sglang.srt.layers.radix_attention:RadixAttention.forward"
GDN_EXTEND = "sglang.srt.layers.attention.linear.gdn_backend:GDNAttnBackend.forward_extend"
GDN_DECODE = "sglang.srt.layers.attention.linear.gdn_backend:GDNAttnBackend.forward_decode"
LOGITS = "sglang.srt.layers.logits_processor:LogitsProcessor.forward"
_PLAIN = (torch.bfloat16, torch.float16, torch.float32)

Factory = Callable[[TapRecorder, Any], Callable[..., Any]]


def tap_points(model: Any) -> list[tuple[str, Factory]]:
    """The kernel-level points of an SGLang model."""
    return [(ATTENTION, _kv_wrapper), (GDN_EXTEND, _state_wrapper),
            (GDN_DECODE, _state_wrapper), (LOGITS, _logits_wrapper)]


def _name(names: Any, module: Any) -> str | None:
    return names.get(module) or SCOPE.short(module)


def _layer_name(names: Any, layer: Any) -> str | None:
    """``Lk.attn`` of a RadixAttention (registered as ``Lk.attn.attn``) or its GDN twin."""
    name = _name(names, layer)
    if name is None:
        return None
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else name


# -- KV rows -----------------------------------------------------------------------------


def _slot_bytes(pool: Any, layer_id: int, slots: torch.Tensor) -> torch.Tensor | None:
    key = pool.get_key_buffer(layer_id)
    value = pool.get_value_buffer(layer_id) if hasattr(pool, "get_value_buffer") else None
    if not isinstance(key, torch.Tensor) or key.dtype not in _PLAIN:
        return None
    parts = [key.index_select(0, slots.to(key.device)).reshape(len(slots), -1)]
    if isinstance(value, torch.Tensor) and value.data_ptr() != key.data_ptr():
        parts.append(value.index_select(0, slots.to(value.device)).reshape(len(slots), -1))
    return torch.cat([p.contiguous().view(torch.uint8) for p in parts], dim=1)


def _kv_wrapper(recorder: TapRecorder, names: Any) -> Callable[..., Any]:
    from enginetap.tap.record.points import sublayer_wrapper

    batch = FlatBatch()
    sublayer = sublayer_wrapper(recorder, names)  # RadixAttention is a sublayer too

    def tap_kv(wrapped: Any, layer: Any, args: tuple, kwargs: dict) -> Any:
        out = sublayer(wrapped, layer, args, kwargs)
        if not recorder.options.continuity or not recorder.live:
            return out
        call = bind_arguments(wrapped, args, kwargs)
        forward_batch = call["forward_batch"]
        name = _layer_name(names, layer)
        runner = current_runner()
        pool = getattr(runner, "token_to_kv_pool", None)
        if name is None or pool is None or not call.get("save_kv_cache", True):
            return out
        step = recorder.step
        index = recorder.index(torch.device("cpu")).tolist()
        slots = torch.tensor([step.rows.kv_slots[i] for i in index], dtype=torch.long)
        requests = batch.read(recorder).of_rows
        pool_rows = forward_batch.req_pool_indices.to(torch.long).cpu()[requests]
        prev = [max(r["pos"] - 1, 0) for r in recorder.rows]
        table = runner.req_to_token_pool.req_to_token
        previous = table[pool_rows.to(table.device),
                         torch.tensor(prev, dtype=torch.long, device=table.device)]
        written = _slot_bytes(pool, layer.layer_id, slots)
        before = _slot_bytes(pool, layer.layer_id, previous.to(torch.long).cpu())
        if written is not None and before is not None:
            recorder.checkpoint_rows(f"{name}.kv_written", written)
            recorder.checkpoint_rows(f"{name}.kv_prev", before)
        return out

    return tap_kv


# -- recurrent state ---------------------------------------------------------------------


def _state_wrapper(recorder: TapRecorder, names: Any) -> Callable[..., Any]:
    def read(backend: Any, call: dict[str, Any]) -> StateCall | None:
        layer = call["layer"]
        name = _layer_name(names, layer)
        indices = getattr(backend.forward_metadata, "mamba_cache_indices", None)
        if name is None or indices is None:
            return None
        return StateCall(name, indices, lambda: _states(backend, layer.layer_id))

    return state_wrapper(recorder, read)


def _states(backend: Any, layer_id: int) -> list[tuple[str, Any]]:
    cache = backend.req_to_token_pool.mamba2_layer_cache(layer_id)
    return [("state", cache.temporal), ("conv", cache.conv[0])]


# -- sampler -----------------------------------------------------------------------------


def _logits_wrapper(recorder: TapRecorder, names: Any) -> Callable[..., Any]:
    return logits_wrapper(recorder, lambda out: getattr(out, "next_token_logits", None))
