"""A row's outputs depend only on the cache slots (keys, pages, blocks) it attends.

Real KV pools hold non-finite values where no row looks (a slot reserved for padded-token
writes, NaN codes of quantized pools), and a tool that localises corruption must not blame
every padded row for them. For every family that reads a cache through indices, lengths or
masks, each row is run again with NaN (and NaN codes: e4m3 0x7F, E8M0 255) planted in every
slot that row does not read: its outputs must stay bit for bit the same.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from enginetap.definitions import compile_reference, get_template

Masks = dict[str, torch.Tensor]
"""Input name -> bool mask over its leading slot dimensions: True where the row reads."""


def _pages_read(pages: list[int], length: int, shape: tuple[int, int]) -> torch.Tensor:
    read = torch.zeros(shape, dtype=torch.bool)
    page_size = shape[1]
    for j, page in enumerate(pages):
        read[page, : max(0, min(page_size, length - j * page_size))] = True
    return read


def _slots_read(slots: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    read = torch.zeros(shape[0] * shape[1], dtype=torch.bool)
    read[slots.long()] = True
    return read.view(shape)


def _ragged(inputs: dict, r: int) -> Masks:
    qo, kv = inputs["qo_indptr"].tolist(), inputs["kv_indptr"].tolist()
    b = next(i for i in range(len(qo) - 1) if qo[i] <= r < qo[i + 1])
    last = kv[b] + (r - qo[b]) + (kv[b + 1] - kv[b]) - (qo[b + 1] - qo[b])
    read = torch.zeros(inputs["k"].shape[0], dtype=torch.bool)
    read[kv[b]: last + 1] = True
    return {"k": read, "v": read}


def _paged(names: tuple[str, ...]) -> Callable[[dict, int], Masks]:
    def reads(inputs: dict, b: int) -> Masks:
        indptr = inputs["kv_indptr"].tolist()
        pages = inputs["kv_indices"][indptr[b]:indptr[b + 1]].tolist()
        cache = inputs[names[0]]
        length = (len(pages) - 1) * cache.shape[1] + int(inputs["kv_last_page_len"][b])
        read = _pages_read(pages, length, tuple(cache.shape[:2]))
        return dict.fromkeys(names, read)
    return reads


def _paged_prefill(inputs: dict, r: int) -> Masks:
    """Query row ``r`` (the ``i``-th of request ``b``'s ``n``) reads the first
    ``L - n + i + 1`` of ``b``'s ``L`` tokens (causal over its cached prefix)."""
    qo, kv = inputs["qo_indptr"].tolist(), inputs["kv_indptr"].tolist()
    b = next(i for i in range(len(qo) - 1) if qo[i] <= r < qo[i + 1])
    pages = inputs["kv_indices"][kv[b]:kv[b + 1]].tolist()
    cache = inputs["ckv_cache"]
    total = (len(pages) - 1) * cache.shape[1] + int(inputs["kv_last_page_len"][b])
    length = total - (qo[b + 1] - qo[b]) + (r - qo[b]) + 1
    read = _pages_read(pages, length, tuple(cache.shape[:2]))
    return {"ckv_cache": read, "kpe_cache": read}


def _dsa(inputs: dict, t: int) -> Masks:
    row = inputs["sparse_indices"][t]
    read = _slots_read(row[row >= 0], tuple(inputs["ckv_cache"].shape[:2]))
    return {"ckv_cache": read, "kpe_cache": read}


def _prefill_sink(inputs: dict, t: int) -> Masks:
    row = inputs["sparse_indices"][t][: int(inputs["topk_lens"][t])]
    read = _slots_read(row[row >= 0], tuple(inputs["ckv_cache"].shape[:2]))
    return {"ckv_cache": read, "kpe_cache": read}


def _decode_sink(inputs: dict, b: int) -> Masks:
    out: Masks = {}
    for scope in ("8", "4"):
        row = inputs[f"indices{scope}"][b]
        read = _slots_read(row[row >= 0], tuple(inputs[f"ckv{scope}_cache"].shape[:2]))
        out.update(dict.fromkeys((f"ckv{scope}_cache", f"ckv{scope}_scale",
                                  f"kpe{scope}_cache"), read))
    return out


def _sparse_gqa(definition) -> Callable[[dict, int], Masks]:
    block, page = definition.const_axes["block_size"], definition.const_axes["page_size"]

    def reads(inputs: dict, s: int) -> Masks:
        read = torch.zeros(inputs["k_cache"].shape[:2], dtype=torch.bool)
        length = int(inputs["seq_lens"][s])
        for b in inputs["block_ids"][s].flatten().tolist():
            for token in range(b * block, min((b + 1) * block, length)) if b >= 0 else ():
                read[int(inputs["page_table"][s, token // page]), token % page] = True
        return {"k_cache": read, "v_cache": read}
    return reads


def _indexer(inputs: dict, t: int) -> Masks:
    read = torch.zeros(inputs["k_index"].shape[0], dtype=torch.bool)
    read[int(inputs["key_start"][t]): int(inputs["key_end"][t])] = True
    return {"k_index": read}


def _compressed(definition) -> Callable[[dict, int], Masks]:
    block, page = definition.const_axes["block_size"], definition.const_axes["page_size"]

    def reads(inputs: dict, t: int) -> Masks:
        read = torch.zeros(inputs["kc_cache"].shape[:2], dtype=torch.bool)
        for b in range(int(inputs["seq_lens"][t]) // block):
            read[int(inputs["page_table"][t, b // page]), b % page] = True
        return {"kc_cache": read}
    return reads


READERS: dict[str, Callable] = {
    "gqa_ragged_prefill": lambda d: _ragged,
    "gqa_paged_decode": lambda d: _paged(("k_cache", "v_cache")),
    "mla_paged_decode": lambda d: _paged(("ckv_cache", "kpe_cache")),
    "mla_paged_prefill": lambda d: _paged_prefill,
    "dsa_sparse_mla": lambda d: _dsa,
    "sparse_mla_prefill_sink": lambda d: _prefill_sink,
    "mla_decode_fp8_fp4_sink": lambda d: _decode_sink,
    "sparse_gqa_paged_decode": _sparse_gqa,
    "dsa_indexer_topk": lambda d: _indexer,
    "compressed_sparse_topk": _compressed,
}


def _plant(name: str, tensor: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
    """``tensor`` with a non-finite value (or NaN code) wherever ``read`` is False."""
    unread = ~read.view(*read.shape, *([1] * (tensor.dim() - read.dim()))).expand(tensor.shape)
    if tensor.dtype == torch.float8_e4m3fn:
        bytes_ = tensor.view(torch.uint8).clone()
        bytes_[unread] = 0x7F  # e4m3fn NaN
        return bytes_.view(torch.float8_e4m3fn)
    if tensor.dtype == torch.int8:
        if not name.endswith("_scale"):
            return tensor  # packed e2m1 codes: every code is finite
        planted = tensor.clone()
        planted[unread] = -1  # the byte 255: E8M0 NaN
        return planted
    planted = tensor.clone()
    planted[unread] = float("nan")
    return planted


def _rows(outputs: tuple, r: int) -> list[torch.Tensor]:
    return [o[r] for o in outputs]


@pytest.mark.parametrize("family", sorted(READERS))
def test_rows_ignore_non_finite_values_in_slots_they_do_not_read(family: str) -> None:
    template = get_template(family)
    definition = template.example_definition()
    run = compile_reference(definition.reference, definition.name)
    reads = READERS[family](definition)
    checked = 0
    for index in range(2):
        axes = template.axes_for(definition.const_axes, index)
        inputs = template.synthetic_inputs(definition, axes, seed=21 + index)
        baseline = run(**inputs)
        baseline = baseline if isinstance(baseline, tuple) else (baseline,)
        for r in range(baseline[0].shape[0]):
            masks = reads(inputs, r)
            planted = {k: _plant(k, v, masks[k]) if k in masks else v
                       for k, v in inputs.items()}
            again = run(**planted)
            again = again if isinstance(again, tuple) else (again,)
            for want, got in zip(_rows(baseline, r), _rows(again, r)):
                assert torch.equal(want.view(torch.uint8) if want.is_floating_point() else want,
                                   got.view(torch.uint8) if got.is_floating_point() else got), \
                    (family, index, r)
            checked += sum(int((~m).sum()) for m in masks.values())
    assert checked > 0, "no row left any slot unread: the test would show nothing"
