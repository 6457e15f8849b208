"""Helpers shared by the built-in engine's probes: real rows of the padded batch, requests,
pages and the notes that describe each change of layout.

The built-in engine runs a left-padded batch ``[batch, columns, ...]``; step row ``i`` is
token ``rows.token_index[i] = b * columns + column`` of it (see
:mod:`enginetap.engines.hf.batch`). Rows of one request are contiguous in step order, so a
request is one batch row ``b`` with its real columns in ascending order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from enginetap.capture.probe import ProbeCall
from enginetap.dataset.schema import Definition
from enginetap.definitions import instantiate as _instantiate

__all__ = ["DTYPES", "PAD_NOTE", "BatchRequest", "Pages", "batch_requests", "column_ranges",
           "end_aligned", "fill_pages", "gather_pages", "instantiate", "live_columns", "one_run",
           "pack_pages", "page_slots", "token_rows", "visible_columns"]

DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

PAD_NOTE = "padding rows of the engine's left-padded batch dropped; rows in step order"


def instantiate(family: str, **values: Any) -> Definition:
    """The family's definition for ``values``, kept per distinct values: these probes build
    one on every captured call."""
    return _instantiate(family, cached=True, **values)


def token_rows(call: ProbeCall, tensor: torch.Tensor) -> torch.Tensor:
    """The step's real token rows of ``tensor`` (``[batch, columns, *rest]``, or already
    flat ``[tokens, *rest]``), as ``[rows, *rest]`` in step-row order (padding dropped);
    without a gather when every row is real and in order (a view of the engine's tensor:
    capture copies it out before the engine goes on)."""
    step = call.step
    padded = step.padded_tokens or len(step.rows)
    flat = tensor.reshape(padded, *tensor.shape[2:]) if tensor.dim() >= 2 and \
        tensor.shape[0] * tensor.shape[1] == padded and tensor.shape[0] != padded else tensor
    if flat.shape[0] == padded and step.memo(("hf.rows.every", padded), lambda: (
            step.rows.token_index == list(range(padded)))):
        return flat  # no padding row to drop (a full decode batch): no gather to launch
    index = step.device_rows("token_index", flat.device)
    return flat.index_select(0, index)


@dataclass(frozen=True)
class BatchRequest:
    """One request of the step: its batch row, real columns and step rows."""

    batch_row: int
    columns: list[int]
    rows: list[int]
    key: str


def batch_requests(call: ProbeCall) -> list[BatchRequest]:
    """The step's requests in step order, from ``rows.token_index`` and the input shape."""
    step = call.step
    columns = int(step.extra["input_shape"][1])
    index = step.rows.token_index or list(range(len(step.rows)))
    found: dict[int, BatchRequest] = {}
    for row, flat in enumerate(index):
        b, column = divmod(flat, columns)
        if b not in found:
            found[b] = BatchRequest(b, [], [], step.rows.keys[row])
        found[b].columns.append(column)
        found[b].rows.append(row)
    return list(found.values())


def column_ranges(columns: list[int]) -> str:
    """``[0, 1, 2, 5, 6]`` → ``"0-2,5-6"`` (how notes name original cache columns)."""
    if len(columns) > 1 and one_run(columns):
        return f"{columns[0]}-{columns[-1]}"  # one run: no per-column loop
    parts, start = [], None
    for i, c in enumerate(columns):
        if start is None:
            start = c
        if i + 1 == len(columns) or columns[i + 1] != c + 1:
            parts.append(f"{start}-{c}" if c != start else f"{c}")
            start = None
    return ",".join(parts)


def visible_columns(mask: torch.Tensor | None, is_causal: bool, b: int, q_len: int,
                    kv_len: int) -> torch.Tensor:
    """``[q_len, kv_len]`` bool: which key columns each query column of batch row ``b``
    may attend, from the mask the kernel got (bool, or additive float), or from
    ``is_causal`` (top-left aligned, as SDPA reads it) when there is none."""
    if mask is None:
        if is_causal:
            return torch.ones(q_len, kv_len, dtype=torch.bool).tril()
        return torch.ones(q_len, kv_len, dtype=torch.bool)
    row = mask[b if mask.shape[0] > 1 else 0]
    row = row[0] if row.dim() == 3 else row
    row = row.expand(q_len, kv_len)
    if row.dtype == torch.bool:
        return row.cpu()
    return (row > torch.finfo(row.dtype).min / 2).cpu()


def end_aligned(seen: torch.Tensor, columns: list[int]) -> tuple[list[int], bool]:
    """A request's live key columns (those its last query sees, in cache order) and whether
    each of its queries sees exactly a prefix of them ending at its own place: query ``i``
    of ``n`` sees the first ``len(live) - n + i + 1`` (queries at the end of their keys).
    ``seen`` is :func:`visible_columns` of the request's batch row."""
    queries = seen[columns]
    live = torch.nonzero(queries[-1]).flatten()
    n, total = len(columns), int(live.numel())
    expected = torch.zeros_like(queries)
    # query i sees the first total - n + i + 1 live columns (vectorised: no per-query loop)
    limit = torch.arange(n) + (total - n + 1)
    expected[:, live] = torch.arange(total)[None, :] < limit[:, None]
    return live.tolist(), total >= n and torch.equal(queries, expected)


@dataclass
class Pages:
    """Requests' tokens packed into a compact paged cache (page ids 0, 1, ... in order)."""

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor
    notes: list[str]


def pack_pages(lengths: list[int], page_size: int) -> Pages:
    """Page tables for requests of ``lengths`` tokens, each on its own fresh pages."""
    counts = [max(1, math.ceil(n / page_size)) for n in lengths]
    indptr = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    indptr[1:] = torch.tensor(counts, dtype=torch.int32).cumsum(0)
    last = [n - (c - 1) * page_size for n, c in zip(lengths, counts)]
    return Pages(indptr, torch.arange(int(indptr[-1]), dtype=torch.int32),
                 torch.tensor(last, dtype=torch.int32), [])


Slots = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]
"""Per page slot: the batch row and the column it comes from, and which slots are unused
(None when every slot is used)."""


def live_columns(mask: torch.Tensor | None, is_causal: bool, requests: list[BatchRequest],
                 q_len: int, kv_len: int) -> tuple[list[list[int]], bool]:
    """For every request at once: its live key columns (those its last query sees, in
    cache order), and whether each request's queries sit at the end of them (query ``i``
    of ``n`` sees exactly the first ``len(live) - n + i + 1``) — what
    :func:`visible_columns` and :func:`end_aligned` say request by request, from one host
    copy of the mask and a few whole-batch array operations (per request, about ten tensor
    operations took 1.8 ms of a 32-request decode step on the CPU).

    NumPy, not torch, on the host: some of torch's CPU operations (``repeat_interleave``)
    split even a 32-element input over the engine's intra-op threads; beside a busy writer
    process the page tables built that way took 40 ms of a decode step on the H200
    machine's 16 cores (1.6 ms with one intra-op thread)."""
    if not requests:
        return [], True
    if mask is None:
        seen = np.tril(np.ones((q_len, kv_len), dtype=bool)) if is_causal \
            else np.ones((q_len, kv_len), dtype=bool)
        seen = seen[None]
    else:
        rows = mask[:, 0] if mask.dim() == 4 else mask[:, None] if mask.dim() == 2 else mask
        if rows.dtype != torch.bool:
            rows = rows > torch.finfo(rows.dtype).min / 2
        seen = rows.expand(rows.shape[0], q_len, kv_len).cpu().numpy()
    batch_rows = np.array([r.batch_row if seen.shape[0] > 1 else 0 for r in requests])
    counts = np.array([len(r.columns) for r in requests])
    query_rows = np.repeat(batch_rows, counts)
    query_columns = np.fromiter((c for r in requests for c in r.columns), dtype=np.int64,
                                count=int(counts.sum()))
    queries = seen[query_rows, query_columns]  # [all queries, kv_len]
    last = np.cumsum(counts) - 1
    live = queries[last]  # [requests, kv_len]: what each request's last query sees
    totals = live.sum(axis=1)
    rank = np.cumsum(live, axis=1) - 1  # rank of each live column among its request's
    request_of = np.repeat(np.arange(len(requests)), counts)
    place = np.arange(len(query_rows)) - np.repeat(last - counts + 1, counts)
    limit = totals[request_of] - counts[request_of] + place + 1
    expected = live[request_of] & (rank[request_of] < limit[:, None])
    ok = bool((totals >= counts).all()) and bool(np.array_equal(queries, expected))
    firsts = live.argmax(axis=1)
    columns = [list(range(int(f), int(f) + int(n))) if n and live[i, f:f + n].all()
               else np.flatnonzero(live[i]).tolist()
               for i, (f, n) in enumerate(zip(firsts, totals))]
    return columns, ok


def one_run(columns: list[int]) -> bool:
    """Whether increasing ``columns`` are one run of consecutive columns (not empty)."""
    return bool(columns) and columns[-1] - columns[0] + 1 == len(columns)


def page_slots(pages: Pages, columns: list[list[int]], rows: list[int], page_size: int,
               device: torch.device) -> Slots:
    """Where every slot of ``pages`` (:func:`pack_pages` of the requests' lengths) comes
    from, for requests whose live tokens are ``columns[i]`` of batch row ``rows[i]`` of a
    ``[batch, heads, width, ...]`` tensor: ``(batch row, column, unused)`` on ``device``,
    one entry per slot (unused slots of last pages repeat a live token and are zeroed).
    Once per step (the same for every layer), in NumPy for the reason
    :func:`live_columns` gives."""
    lengths = np.array([len(c) for c in columns], dtype=np.int64)
    slots = np.diff(pages.indptr.numpy()).astype(np.int64) * page_size
    request = np.repeat(np.arange(len(columns)), slots)
    offset = np.arange(int(slots.sum())) - (np.cumsum(slots) - slots)[request]
    length = lengths[request]
    valid = offset < length
    within = np.minimum(offset, np.maximum(length - 1, 0))
    if all(map(one_run, columns)):  # the usual case
        column = np.array([c[0] for c in columns], dtype=np.int64)[request] + within
    else:
        flat = np.fromiter((c for cs in columns for c in cs), dtype=np.int64,
                           count=int(lengths.sum())) if lengths.sum() else np.zeros(1, np.int64)
        token = (np.cumsum(lengths) - lengths)[request] + within
        column = flat[np.minimum(token, flat.size - 1)]
    unused = None if valid.all() else torch.from_numpy(~valid).to(device, non_blocking=True)
    return (torch.from_numpy(np.asarray(rows, dtype=np.int64)[request]).to(
                device, non_blocking=True),
            torch.from_numpy(column).to(device, non_blocking=True), unused)


def gather_pages(cache: torch.Tensor, slots: Slots, page_size: int) -> torch.Tensor:
    """``[pages, page_size, heads, dim]`` from an engine cache ``[batch, heads, columns,
    dim]`` (any strides): one gather of the live columns at :func:`page_slots`'s slots,
    unused slots zero (equal to :func:`fill_pages` of each request's live columns). Only
    the live columns are read: no transposed copy of the whole cache first."""
    rows, columns, unused = slots
    batch, heads, width, dim = cache.shape
    picked = cache[rows, :, columns]  # [slots, heads, dim]
    if unused is not None:
        picked.masked_fill_(unused[:, None, None], 0)
    return picked.reshape(-1, page_size, heads, dim)


def fill_pages(tokens: list[torch.Tensor], page_size: int) -> torch.Tensor:
    """``[pages, page_size, *rest]``: each request's ``[n, *rest]`` tokens from its first
    page on (as :func:`pack_pages` numbers them); unused slots of last pages are zero."""
    rest = tokens[0].shape[1:]
    counts = [max(1, math.ceil(t.shape[0] / page_size)) for t in tokens]
    out = tokens[0].new_zeros((sum(counts) * page_size, *rest))
    start = 0
    for t, c in zip(tokens, counts):
        out[start:start + t.shape[0]] = t
        start += c * page_size
    return out.reshape(sum(counts), page_size, *rest)
