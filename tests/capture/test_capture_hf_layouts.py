"""The layout helpers of the built-in engine's probes: pages, masks, column notes."""

from __future__ import annotations

import torch

from enginetap.engines.hf.probes.common import (
    BatchRequest,
    column_ranges,
    end_aligned,
    fill_pages,
    gather_pages,
    live_columns,
    pack_pages,
    page_slots,
    visible_columns,
)


def test_packed_pages_give_back_each_requests_tokens_in_order():
    gen = torch.Generator().manual_seed(0)
    lengths, page_size = [1, 16, 17, 40], 16
    tokens = [torch.randn(n, 2, 4, generator=gen) for n in lengths]
    pages = pack_pages(lengths, page_size)
    cache = fill_pages(tokens, page_size)
    assert pages.indptr.tolist() == [0, 1, 2, 4, 7]
    assert pages.last_page_len.tolist() == [1, 16, 1, 8]
    assert cache.shape == (7, page_size, 2, 4)
    for b, expected in enumerate(tokens):
        ids = pages.indices[pages.indptr[b]:pages.indptr[b + 1]].long()
        got = cache[ids].reshape(-1, 2, 4)[:lengths[b]]
        assert torch.equal(got, expected)


def test_one_gather_pages_a_dense_cache_as_the_per_request_copies_do():
    # the decode adapter's vectorised paging (once per step, one gather per layer) against
    # the per-request copies: runs, a gap, one token, a whole row; unused slots zero
    gen = torch.Generator().manual_seed(1)
    batch, heads, width, dim, page_size = 4, 3, 37, 5, 16
    cache = torch.randn(batch, heads, width, dim, generator=gen)
    columns = [list(range(17, 37)), [36], [3, 4, 9, 10, 11, 36], list(range(37))]
    rows = [0, 2, 1, 3]
    pages = pack_pages([len(c) for c in columns], page_size)
    got = gather_pages(cache, page_slots(pages, columns, rows, page_size,
                                         cache.device), page_size)
    expected = fill_pages([cache[r, :, c].transpose(0, 1) for r, c in zip(rows, columns)],
                          page_size)
    assert got.shape == expected.shape == (7, page_size, heads, dim)
    assert torch.equal(got, expected)
    # a strided view of a larger cache (the first head of each repeat_kv group), as the
    # decode adapter passes it: the same pages
    grouped = torch.randn(batch, heads, 2, width, dim, generator=gen)
    view = grouped[:, :, 0]
    got = gather_pages(view, page_slots(pages, columns, rows, page_size,
                                        view.device), page_size)
    expected = fill_pages([view[r, :, c].transpose(0, 1) for r, c in zip(rows, columns)],
                          page_size)
    assert torch.equal(got, expected)
    # every request's columns one run (the usual case, paged without a flat column list)
    runs = [list(range(17, 37)), [36], list(range(37))]
    run_pages = pack_pages([len(c) for c in runs], page_size)
    got = gather_pages(cache, page_slots(run_pages, runs, [0, 2, 3], page_size,
                                         cache.device), page_size)
    assert torch.equal(got, fill_pages([cache[r, :, c].transpose(0, 1)
                                        for r, c in zip([0, 2, 3], runs)], page_size))
    # every slot used (no last page left partly empty): nothing to zero
    full = [list(range(16)), list(range(5, 37))]
    full_pages = pack_pages([16, 32], page_size)
    slots = page_slots(full_pages, full, [1, 0], page_size, cache.device)
    assert slots[2] is None
    assert torch.equal(gather_pages(cache, slots, page_size), fill_pages(
        [cache[r, :, c].transpose(0, 1) for r, c in zip([1, 0], full)], page_size))


def test_left_padded_prefix_and_suffix_columns_are_end_aligned():
    # Row layout of the engine: pad | 3 reused | pad | 2 new tokens; causal by column.
    live = torch.tensor([False, True, True, True, False, True, True])
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    mask = (causal & live).reshape(1, 1, 7, 7)
    seen = visible_columns(mask, False, 0, 7, 7)
    columns, ok = end_aligned(seen, [5, 6])
    assert ok and columns == [1, 2, 3, 5, 6]
    assert column_ranges(columns) == "1-3,5-6"


def test_a_sliding_window_mask_is_not_end_aligned():
    # Query 6 cannot see column 1 any more: no prefix of the live keys describes it.
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    window = causal & ~torch.ones(7, 7, dtype=torch.bool).tril(-5)
    _, ok = end_aligned(visible_columns(window.reshape(1, 1, 7, 7), False, 0, 7, 7), [5, 6])
    assert not ok


def test_additive_float_masks_and_no_mask_read_as_visibility():
    additive = torch.zeros(1, 1, 2, 3)
    additive[0, 0, 0, 2] = torch.finfo(torch.float32).min
    assert visible_columns(additive, False, 0, 2, 3).tolist() == [[True, True, False],
                                                                   [True, True, True]]
    assert visible_columns(None, True, 0, 2, 2).tolist() == [[True, False], [True, True]]
    assert visible_columns(None, False, 0, 1, 3).all()


def _per_request(mask, causal, requests, q_len, kv_len):
    found = [end_aligned(visible_columns(mask, causal, r.batch_row, q_len, kv_len), r.columns)
             for r in requests]
    return [columns for columns, _ in found], all(ok for _, ok in found)


def test_the_whole_batch_live_columns_agree_with_the_per_request_reading():
    # live_columns (one pass over the batch) against visible_columns + end_aligned per
    # request, on the masks the engine makes and on ones the definitions must refuse
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    pad = torch.tensor([[False] * 3 + [True] * 6,  # left padding
                        [True] * 9,  # none
                        [False, True, True, False, False, True, True, True, True]])  # gap
    prefill = (causal & pad[:, None, :]).reshape(3, 1, 9, 9)
    window = prefill & ~torch.ones(9, 9, dtype=torch.bool).tril(-4)
    decode = pad.reshape(3, 1, 1, 9)
    additive = torch.zeros(3, 1, 1, 9).masked_fill(~decode, torch.finfo(torch.float32).min)
    ask = [BatchRequest(0, [6, 7, 8], [0, 1, 2], "a"), BatchRequest(1, [4, 5, 6, 7, 8],
                                                                    [3, 4, 5, 6, 7], "b"),
           BatchRequest(2, [7, 8], [8, 9], "c")]
    one = [BatchRequest(b, [0], [b], k) for b, k in enumerate("abc")]
    cases = [(prefill, False, ask, 9, 9, True), (window, False, ask, 9, 9, False),
             (decode, False, one, 1, 9, True), (additive, False, one, 1, 9, True),
             (None, True, [BatchRequest(0, [3, 4], [0, 1], "a")], 5, 5, True),
             (None, False, [BatchRequest(0, [0], [0], "a")], 1, 4, True),
             (prefill[:1], False, [BatchRequest(0, [8], [0], "a")], 9, 9, True),
             (prefill, False, [BatchRequest(2, [0], [0], "c")], 9, 9, False)]
    for mask, is_causal, requests, q_len, kv_len, ok in cases:
        got = live_columns(mask, is_causal, requests, q_len, kv_len)
        assert got == _per_request(mask, is_causal, requests, q_len, kv_len)
        assert got[1] is ok
    columns, _ = live_columns(decode, False, one, 1, 9)
    assert columns == [[3, 4, 5, 6, 7, 8], list(range(9)), [1, 2, 5, 6, 7, 8]]
