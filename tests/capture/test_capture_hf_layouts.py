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
             (prefill, False, [BatchRequest(2, [0], [0], "c")], 9, 9, False),
             (pad, False, one, 1, 9, True),  # a [batch, keys] padding mask
             (prefill[:, 0], False, ask, 9, 9, True)]  # [batch, queries, keys]
    for mask, is_causal, requests, q_len, kv_len, ok in cases:
        got = live_columns(mask, is_causal, requests, q_len, kv_len)
        assert got == _per_request(mask, is_causal, requests, q_len, kv_len)
        assert got[1] is ok
    columns, _ = live_columns(decode, False, one, 1, 9)
    assert columns == [[3, 4, 5, 6, 7, 8], list(range(9)), [1, 2, 5, 6, 7, 8]]


def _decode_call(batch_rows: list[int], batch: int):
    """A decode SDPA call of a ``batch``-row padded batch whose requests sit in
    ``batch_rows`` (the other rows are padding), with its step."""
    from enginetap.capture.probe import ProbeCall, Probe
    from enginetap.core.context import Step, StepRows
    from enginetap.engines.hf.probes.attention import PAGE_SIZE
    from enginetap.engines.hf.probes.common import instantiate

    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, dim, width = 4, 2, 8, 21
    q = torch.randn(batch, heads, 1, dim, generator=gen)
    k = torch.randn(batch, kv_heads, width, dim, generator=gen)
    v = torch.randn(batch, kv_heads, width, dim, generator=gen)
    mask = torch.zeros(batch, 1, 1, width, dtype=torch.bool)
    for i, b in enumerate(batch_rows):
        mask[b, 0, 0, 3 + i:] = True  # each request its own left padding
    n = len(batch_rows)
    rows = StepRows([f"r{b}" for b in batch_rows], [width - 1] * n, [5] * n, list(range(n)),
                    [width - 1] * n, token_index=list(batch_rows))
    step = Step("test", 3, "decode", rows, padded_tokens=batch,
                extra={"input_shape": [batch, 1]})
    definition = instantiate("gqa_paged_decode", num_qo_heads=heads, num_kv_heads=kv_heads,
                             head_dim=dim, dtype="float32", page_size=PAGE_SIZE)
    args = {"query": q, "key": k, "value": v, "attn_mask": mask, "dropout_p": 0.0,
            "is_causal": False, "scale": None, "enable_gqa": True}
    result = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                              enable_gqa=True)
    probe = Probe("t", "gqa_paged_decode", lambda c: definition, lambda c: None)
    return ProbeCall(probe, None, args, step, None, result=result, definition=definition)


def test_the_decode_adapter_keeps_only_request_rows_and_their_pages():
    # a full batch (every row a request: the adapter picks nothing) and one with a row that
    # is no request (its query, output and cache must not reach the workload)
    from enginetap.engines.hf.probes.attention import _adapt_decode

    for batch_rows, batch in (([0, 1, 2], 3), ([0, 2, 3], 4)):
        call = _decode_call(batch_rows, batch)
        got = _adapt_decode(call)
        assert got is not None
        q, out = call.args["query"][:, :, 0], call.result[:, :, 0]
        assert torch.equal(got.inputs["q"], q[batch_rows])
        assert torch.equal(got.outputs["output"], out[batch_rows])
        live = [list(range(3 + i, 21)) for i in range(len(batch_rows))]
        for name in ("key", "value"):
            expected = fill_pages([call.args[name][b, :, c].transpose(0, 1)
                                   for b, c in zip(batch_rows, live)], 16)
            assert torch.equal(got.inputs[f"{name[0]}_cache"], expected)


def test_token_rows_drop_padding_rows_and_pass_a_full_batch_as_it_is():
    from enginetap.engines.hf.probes.common import token_rows

    x = torch.arange(4 * 2 * 3, dtype=torch.float32).reshape(4, 2, 3)  # [batch, columns, w]
    padded = _decode_call([0, 2, 3], 4)
    padded.step.extra["input_shape"] = [4, 2]
    padded.step.padded_tokens = 8
    padded.step.rows.token_index = [1, 5, 7]
    assert torch.equal(token_rows(padded, x), x.reshape(8, 3)[[1, 5, 7]])
    full = _decode_call([0, 1, 2], 3)
    y = torch.randn(3, 1, 5)
    assert token_rows(full, y).data_ptr() == y.data_ptr()  # nothing gathered
    assert torch.equal(token_rows(full, y), y)
