"""GQA attention probes of the built-in engine: the SDPA kernel call of every ``*Attention``.

transformers looks its attention function up in a dict (``ALL_ATTENTION_FUNCTIONS``), so
the hook is the kernel that function calls by attribute: ``torch.nn.functional.
scaled_dot_product_attention``, only while a ``*Attention`` sublayer runs. It gets
``query [B, Hq, Lq, D]`` and ``key``/``value [B, H, Lk, D]`` over the whole padded dense
cache, where ``H`` is ``Hq`` (transformers repeated the kv heads, ``repeat_kv``, because a
mask is given) or the kv heads (``enable_gqa``), plus a bool ``[B, 1, Lq, Lk]`` mask (or
none). The adapters keep the real query rows, recover the kv heads, and take each request's
live cache columns from the mask the kernel got:

- prefill → ``gqa_ragged_prefill``: the request's live columns packed in cache order (its
  reused prefix, then its prompt suffix), queries at the end of them;
- decode → ``gqa_paged_decode``: the live columns packed into fresh pages of the
  definition's page size, pages numbered 0.. in request order (compacted).

Each query's visible columns are checked against the definition's causal rule (queries at
the end of their keys); a mask the definition cannot describe is declined, never bent.
MLA modules (DeepSeek) call the same kernel; they are left to the MLA probe.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import torch

from enginetap.capture.probe import Extracted, Probe, ProbeCall
from enginetap.core.scope import current_module
from enginetap.dataset.schema import Definition
from enginetap.engines.hf.probes.common import (
    DTYPES,
    PAD_NOTE,
    batch_requests,
    column_ranges,
    gather_pages,
    instantiate,
    live_columns,
    one_run,
    pack_pages,
    page_slots,
)

__all__ = ["ATTENTION_PROBES", "PAGE_SIZE"]

PAGE_SIZE = 16
"""Tokens per page of the captured decode cache (the catalog's default page size)."""

SDPA = "torch.nn.functional:scaled_dot_product_attention"


def _sdpa_signature(query: Any, key: Any, value: Any, attn_mask: Any = None,
                    dropout_p: float = 0.0, is_causal: bool = False, scale: Any = None,
                    enable_gqa: bool = False) -> None:
    """The parameters of ``torch.nn.functional.scaled_dot_product_attention`` (a builtin
    without an introspectable signature)."""


def _gqa_shape(call: ProbeCall) -> tuple[int, int, int, str] | None:
    """``(q heads, kv heads, head dim, dtype)`` when this call is plain GQA, else None."""
    module = current_module()
    q, k, v = call.args["query"], call.args["key"], call.args["value"]
    if module is None or hasattr(module, "kv_lora_rank") or call.args["dropout_p"]:
        return None
    dtype = DTYPES.get(q.dtype)
    if q.dim() != 4 or k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1] or not dtype:
        return None
    heads = int(q.shape[1])
    groups = int(getattr(module, "num_key_value_groups", 1))
    if heads % groups:
        return None
    return heads, heads // groups, int(q.shape[-1]), dtype


def _define(call: ProbeCall) -> Definition | None:
    shape = _gqa_shape(call)
    if shape is None or call.step.mode == "mixed":
        return None
    heads, kv_heads, head_dim, dtype = shape
    gqa = {"num_qo_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim, "dtype": dtype}
    if call.step.mode == "prefill":
        return instantiate("gqa_ragged_prefill", **gqa)
    return instantiate("gqa_paged_decode", **gqa, page_size=PAGE_SIZE)


def _kv_heads(tensor: torch.Tensor, kv_heads: int, notes: list[str], name: str,
              checks: list[tuple[torch.Tensor, str]]) -> torch.Tensor:
    """``[B, kv_heads, Lk, D]``: undo transformers' ``repeat_kv``. Checked, not assumed:
    the check (every head equal to the first of its group, bit for bit) is computed on
    the tensor's device and added to ``checks``, for the writer to read (asking the host
    here would stop the engine until the device caught up, twice per layer).

    The check reads every 16th key column and the last one (this step's), every head
    and every byte of them: heads that are not repeats (other projections, another
    layout) differ in every column, so a sample finds them; comparing whole caches was
    1.4 ms of device time per decode step on the H200 (8 layers × 32 requests × 512
    columns), a sixth of what capturing the step added besides the copy itself."""
    heads = tensor.shape[1]
    if heads == kv_heads:
        return tensor
    if heads % kv_heads:
        raise ValueError(f"{name}: the engine's {heads} heads are not a multiple of "
                         f"{kv_heads} kv heads")
    group = heads // kv_heads
    grouped = tensor.unflatten(1, (kv_heads, group))
    words = _words(grouped)  # [B, kv heads, group, Lk, words]
    same = torch.cat([words[:, :, :, ::_CHECK_EVERY], words[:, :, :, -1:]], dim=3)
    checks.append(((same[:, :, 1:] == same[:, :, :1]).all(),
                   f"{name}: the engine's {heads} heads are not {kv_heads} kv heads each "
                   f"repeated {group} times (repeat_kv)"))
    if name == "key":
        notes.append(f"kv heads: the engine repeated each of {kv_heads} kv heads {group} times "
                     "(repeat_kv, since a mask is given) before the kernel; one of each kept")
    return grouped[:, :, 0]


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as the widest integer words its rows divide into (bit-exact
    comparison; a decode step compares whole caches, so 8-byte words make that check
    an eighth of the elements of a byte view)."""
    same_size = _INT_OF_SIZE.get(tensor.element_size())
    for word in (torch.int64, torch.int32, torch.int16):
        if word.itemsize > tensor.element_size() and tensor.stride(-1) == 1:
            try:
                return tensor.view(word)
            except RuntimeError:  # row bytes or offset not a multiple of the word
                continue
    return tensor if same_size is None else tensor.view(same_size)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHECK_EVERY = 16
"""The repeat_kv check's column stride (plus the last column)."""


class _Live:
    """Per request: live key columns, and whether every request's queries sit at the end
    of them (the definitions' causal rule)."""

    def __init__(self, call: ProbeCall, q_len: int, kv_len: int) -> None:
        self.requests = batch_requests(call)
        self.columns, self.ok = live_columns(call.args["attn_mask"],
                                             bool(call.args["is_causal"]), self.requests,
                                             q_len, kv_len)
        self.spans: list[slice | list[int]] = [_span(c) for c in self.columns]
        """Per request its live columns as a slice where they are one run (the usual
        case: a padded batch's live keys are contiguous), so gathering them is a view and
        not a Python list turned into an index tensor."""


def _span(columns: list[int]) -> slice | list[int]:
    """``columns`` (increasing) as a slice when they are consecutive."""
    if one_run(columns):
        return slice(columns[0], columns[-1] + 1)
    return columns


def _live(call: ProbeCall, q_len: int, kv_len: int) -> _Live:
    """:class:`_Live` of this call, shared by every layer of the step that attends through
    the same mask (one analysis per step, not one per layer)."""
    mask = call.args["attn_mask"]
    key = ("hf.attention.live", bool(call.args["is_causal"]), q_len, kv_len,
           None if mask is None else (mask.data_ptr(), tuple(mask.shape), mask.dtype))
    return call.step.memo(key, lambda: _Live(call, q_len, kv_len))


def _adapt_prefill(call: ProbeCall) -> Extracted | None:
    assert call.definition is not None
    q, k, v = call.args["query"], call.args["key"], call.args["value"]
    kv_heads = call.definition.const_axes["num_kv_heads"]
    live = _live(call, q.shape[2], k.shape[2])
    if not live.ok:
        return None  # a mask the definition cannot describe (sliding window, bidirectional)
    notes = [PAD_NOTE, "layouts: engine [batch, heads, columns, dim] -> NHD rows"]
    checks: list[tuple[torch.Tensor, str]] = []
    k = _kv_heads(k, kv_heads, notes, "key", checks)
    v = _kv_heads(v, kv_heads, notes, "value", checks)
    qs, ks, vs, outs, q_lens, kv_lens = [], [], [], [], [], []
    for request, columns, span in zip(live.requests, live.columns, live.spans):
        queries = _span(request.columns)
        qs.append(q[request.batch_row, :, queries].transpose(0, 1))
        outs.append(call.result[request.batch_row, :, queries].transpose(0, 1))
        ks.append(k[request.batch_row, :, span].transpose(0, 1))
        vs.append(v[request.batch_row, :, span].transpose(0, 1))
        q_lens.append(len(request.columns))
        kv_lens.append(len(columns))
        notes.append(f"request {request.key}: keys are its live cache columns "
                     f"{column_ranges(columns)} of batch row {request.batch_row} "
                     f"({len(columns) - len(request.columns)} cached before this step)")
    notes.append("lse: the engine's kernel does not return it; not stored")
    inputs = {"q": torch.cat(qs), "k": torch.cat(ks), "v": torch.cat(vs),
              "qo_indptr": _indptr(q_lens), "kv_indptr": _indptr(kv_lens),
              "sm_scale": _scale(call, q.shape[-1])}
    return Extracted(inputs, {"output": torch.cat(outs)}, notes, checks=checks)


def _adapt_decode(call: ProbeCall) -> Extracted | None:
    assert call.definition is not None
    q, k, v = call.args["query"], call.args["key"], call.args["value"]
    consts = call.definition.const_axes
    live = _live(call, q.shape[2], k.shape[2])
    if not live.ok or any(len(r.columns) != 1 for r in live.requests):
        return None
    notes = [PAD_NOTE, "layouts: engine [batch, heads, columns, dim] -> NHD"]
    checks: list[tuple[torch.Tensor, str]] = []
    k = _kv_heads(k, consts["num_kv_heads"], notes, "key", checks)
    v = _kv_heads(v, consts["num_kv_heads"], notes, "value", checks)
    page_size = consts["page_size"]
    paged = _paged(call, live, page_size, k.device)
    notes += paged.notes
    every = paged.batch_rows == list(range(q.shape[0]))  # no padding row: nothing to pick

    def real(t: torch.Tensor) -> torch.Tensor:
        return t if every else t.index_select(0, paged.rows)

    inputs = {"q": real(q[:, :, 0]),
              "k_cache": gather_pages(k, paged.slots, page_size),
              "v_cache": gather_pages(v, paged.slots, page_size),
              "kv_indptr": paged.pages.indptr, "kv_indices": paged.pages.indices,
              "kv_last_page_len": paged.pages.last_page_len,
              "sm_scale": _scale(call, q.shape[-1])}
    return Extracted(inputs, {"output": real(call.result[:, :, 0])}, notes, checks=checks)


class _Paged:
    """A decode step's page tables, the slots every layer's cache is gathered at, and the
    notes that say so: the same for every layer of the step (built once)."""

    def __init__(self, live: _Live, page_size: int, device: torch.device) -> None:
        rows = self.batch_rows = [r.batch_row for r in live.requests]
        self.device = device
        self.pages = pack_pages([len(c) for c in live.columns], page_size)
        self.slots = page_slots(self.pages, live.columns, rows, page_size, device)
        indptr = self.pages.indptr.tolist()
        self.notes = [f"paged cache: the engine's dense padded cache compacted to each "
                      f"request's live columns, packed into fresh {page_size}-token pages "
                      "numbered in request order; unused slots of last pages are zero"]
        self.notes += [f"request {r.key}: pages {indptr[i]}-{indptr[i + 1] - 1} hold cache "
                       f"columns {column_ranges(c)} of batch row {r.batch_row}"
                       for i, (r, c) in enumerate(zip(live.requests, live.columns))]
        self.notes.append("lse: the engine's kernel does not return it; not stored")

    @cached_property
    def rows(self) -> torch.Tensor:
        """The requests' batch rows on the device, made once per step and only where a
        row must be picked (indexing with a Python list waits for the device)."""
        return torch.tensor(self.batch_rows).to(self.device, non_blocking=True)


def _paged(call: ProbeCall, live: _Live, page_size: int, device: torch.device) -> _Paged:
    return call.step.memo(("hf.attention.paged", id(live), page_size, str(device)),
                          lambda: _Paged(live, page_size, device))


def _indptr(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return out


def _scale(call: ProbeCall, head_dim: int) -> float:
    scale = call.args["scale"]
    return float(scale) if scale is not None else head_dim ** -0.5


ATTENTION_PROBES: list[Probe] = [
    Probe("hf.gqa.prefill", "gqa_ragged_prefill", _define, _adapt_prefill, target=SDPA,
          when="prefill", inside="Attention", signature=_sdpa_signature,
          description="scaled_dot_product_attention inside *Attention on prefill steps"),
    Probe("hf.gqa.decode", "gqa_paged_decode", _define, _adapt_decode, target=SDPA,
          when="decode", inside="Attention", signature=_sdpa_signature,
          description="scaled_dot_product_attention inside *Attention on decode steps"),
]
