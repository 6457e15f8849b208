"""Kernel-level tap points of vLLM CPU (:meth:`VLLMHooks.tap_points`): targets and
wrapper factories, as the tap capability installs them.

- ``Lk.attn.kv_written`` / ``Lk.attn.kv_prev``: after ``CPUAttentionBackendImpl.forward``
  (vLLM wrote the step's keys and values before it), the key and value of each tapped
  row read back from its slot of the layer's cache, and those of the request's previous
  position (its slot from the block table). The cache is packed per ISA: a slot's
  elements are gathered in plain ``[heads, head_dim]`` order through the permutation
  learnt from vLLM's own packing op (:func:`~.probes.packing.kv_unpacker`), so rows of
  any slot compare byte for byte.
- ``Lk.gdn.state_before`` / ``state_after`` and ``conv_before`` / ``conv_after``: around
  ``_cpu_gdn_attention_nonspec`` (one call per gated-delta layer and step, given the
  layer and its metadata), the recurrent and convolution state of each tapped request's
  slot, which the kernels update in place.
- the sampler: the logits ``compute_logits`` returns (one row per request, in the batch's
  request order) of each tapped row's request.

Points are only recorded inside a published step; quantized (fp8) caches and speculative
decoding are not tapped.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any

import torch

from enginetap.core.patching import bind_arguments
from enginetap.core.scope import SCOPE
from enginetap.engines.tapping import StateCall, logits_wrapper, state_wrapper
from enginetap.tap.record import TapRecorder
from enginetap.tap.record.rows import FlatBatch

__all__ = ["ATTENTION", "GDN", "kernel_points", "tap_points"]

ATTENTION = "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.forward"
GDN = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention:_cpu_gdn_attention_nonspec"
_PLAIN = (torch.bfloat16, torch.float16, torch.float32)

Factory = Callable[[TapRecorder, Any], Callable[..., Any]]


def tap_points(model: Any) -> list[tuple[str, Factory]]:
    """The kernel-level points of a vLLM CPU model (``compute_logits`` where it has one)."""
    points: list[tuple[str, Factory]] = [(ATTENTION, _kv_wrapper), (GDN, _state_wrapper)]
    cls = type(model)
    if callable(getattr(cls, "compute_logits", None)):
        points.append((f"{cls.__module__}:{cls.__qualname__}.compute_logits", _logits_wrapper))
    return points


def kernel_points(module: Any, base: str, kind: str) -> list[str]:
    """The kernel-level checkpoints recorded for ``module`` (checkpoint base name
    ``base``, its ``kind``) in a step, in the order they are recorded (a compiled model's
    tap reserves their places: :mod:`.compiled_tap`)."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    if kind == "attn" and isinstance(getattr(module, "impl", None), CPUAttentionBackendImpl):
        return [f"{base.removesuffix('.core')}.{p}" for p in ("kv_written", "kv_prev")]
    if kind == "gdn" and isinstance(module, MambaBase):  # its states come after loading
        return [f"{base}.{label}_{when}" for when in ("before", "after")
                for label in ("state", "conv")]
    return []


def _point(recorder: TapRecorder, name: str, rows: torch.Tensor, per_request: bool) -> None:
    """Record ``rows`` (one per tapped row, or ``per_request``: one per tapped request,
    each tapped row then gets its request's) under ``name``: into the compiled model's tap
    buffer where vLLM compiles the model, else staged as eager checkpoints are."""
    compiled = recorder.compiled  # vLLM's compiled model: a VLLMCompiledTap (.compiled_tap)
    if compiled is not None and hasattr(compiled, "write_rows"):
        if per_request:
            rows = rows.index_select(0, torch.tensor(recorder.request_of_row,
                                                     dtype=torch.long, device=rows.device))
        compiled.write_rows(name, rows)
    elif per_request:
        recorder.checkpoint_requests(name, rows)
    else:
        recorder.checkpoint_rows(name, rows)


def _name(names: Any, module: Any) -> str | None:
    name = names.get(module) or SCOPE.short(module)
    return None if name is None else name.removesuffix(".core")


# -- KV rows -----------------------------------------------------------------------------


@lru_cache(maxsize=32)
def _token_elements(isa: str, heads: int, block_size: int, head_dim: int, dtype: torch.dtype,
                    which: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(head, row, dim) index in a packed ``[heads, block_size, head_dim]`` block half of
    every element of every block offset, ``[block_size, heads * head_dim]`` each, in the
    plain ``[heads, head_dim]`` order of the token at that offset."""
    from enginetap.engines.vllm.probes.packing import kv_unpacker

    perm = kv_unpacker(isa, heads, block_size, head_dim, dtype, which)
    where = torch.empty_like(perm)
    where[perm] = torch.arange(perm.numel())  # plain index -> packed position
    # plain NHD [block_size, heads, head_dim]: token t holds a contiguous run
    where = where.reshape(block_size, heads * head_dim)
    return where // (block_size * head_dim), (where // head_dim) % block_size, where % head_dim


def _slot_bytes(kv_cache: torch.Tensor, isa: str, slots: torch.Tensor) -> torch.Tensor:
    """Key then value bytes of each slot in ``slots``, ``[len(slots), bytes]``."""
    blocks, heads, block_size, width = kv_cache.shape
    halves = kv_cache.view(blocks, heads, 2 * block_size, width // 2).chunk(2, dim=2)
    block, offset = slots // block_size, slots % block_size
    parts = []
    for half, which in zip(halves, ("key", "value")):
        h, t, d = _token_elements(isa, heads, block_size, width // 2, kv_cache.dtype, which)
        values = half[block[:, None], h[offset], t[offset], d[offset]]
        parts.append(values.contiguous().view(torch.uint8))
    return torch.cat(parts, dim=1)


def _previous_slots(recorder: TapRecorder, meta: Any, block_size: int,
                    batch: FlatBatch) -> torch.Tensor:
    """The slot of each tapped row's previous position (its own at position 0)."""
    table = meta.block_table
    prev = [max(r["pos"] - 1, 0) for r in recorder.rows]
    index = torch.tensor([[b, p // block_size] for b, p in zip(batch.of_rows, prev)],
                         dtype=torch.long, device=table.device)
    blocks = table[index[:, 0], index[:, 1]].to(torch.long)
    offsets = torch.tensor([p % block_size for p in prev], dtype=torch.long,
                           device=table.device)
    return blocks * block_size + offsets


def _kv_wrapper(recorder: TapRecorder, names: Any) -> Callable[..., Any]:
    batch = FlatBatch()

    def tap_kv(wrapped: Any, impl: Any, args: tuple, kwargs: dict) -> Any:
        out = wrapped(*args, **kwargs)
        if not recorder.options.continuity or not recorder.live:
            return out
        call = bind_arguments(wrapped, args, kwargs)
        meta, cache, layer = call["attn_metadata"], call["kv_cache"], call["layer"]
        name = _name(names, layer)
        if meta is None or name is None or cache.dim() != 4 or cache.dtype not in _PLAIN \
                or getattr(meta, "encoder_cache", None) is not None:
            return out
        slots = meta.slot_mapping.to(torch.long)[recorder.index(meta.slot_mapping.device)]
        prev = _previous_slots(recorder, meta, int(cache.shape[2]), batch.read(recorder))
        _point(recorder, f"{name}.kv_written", _slot_bytes(cache, layer.isa, slots), False)
        _point(recorder, f"{name}.kv_prev", _slot_bytes(cache, layer.isa, prev), False)
        return out

    return tap_kv


# -- recurrent state ---------------------------------------------------------------------


def _state_wrapper(recorder: TapRecorder, names: Any) -> Callable[..., Any]:
    def read(_: Any, call: dict[str, Any]) -> StateCall | None:
        layer = call["layer"]
        name = _name(names, layer)
        indices = getattr(call["attn_metadata_i"], "non_spec_state_indices_tensor", None)
        if name is None or indices is None:
            return None
        return StateCall(name, indices, lambda: _states(layer))

    return state_wrapper(recorder, read,
                         lambda name, rows: _point(recorder, name, rows, True))


def _states(layer: Any) -> list[tuple[str, Any]]:
    states = getattr(layer, "kv_cache", None)
    if not isinstance(states, (list, tuple)) or len(states) < 2:
        return []
    return [("state", states[1]), ("conv", states[0])]


# -- sampler -----------------------------------------------------------------------------


def _logits_wrapper(recorder: TapRecorder, names: Any) -> Callable[..., Any]:
    return logits_wrapper(recorder)  # compute_logits returns the logits themselves
