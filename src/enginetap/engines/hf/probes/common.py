"""Helpers shared by the built-in engine's probes: real rows of the padded batch, requests,
pages and the notes that describe each change of layout.

The built-in engine runs a left-padded batch ``[batch, columns, ...]``; step row ``i`` is
token ``rows.token_index[i] = b * columns + column`` of it (see
:mod:`enginetap.engines.hf.batch`). Rows of one request are contiguous in step order, so a
request is one batch row ``b`` with its real columns in ascending order.
"""

from __future__ import annotations

import itertools
import math
from array import array
from dataclasses import dataclass
from typing import Any

import torch

from enginetap.capture.probe import ProbeCall
from enginetap.capture.probe import instantiate as cached_instantiate
from enginetap.dataset.schema import Definition
from enginetap.definitions import get_template

__all__ = ["DTYPES", "PAD_NOTE", "BatchRequest", "Pages", "batch_requests", "column_ranges",
           "end_aligned", "fill_pages", "gather_pages", "instantiate", "pack_pages", "page_slots",
           "token_rows", "visible_columns"]

DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

PAD_NOTE = "padding rows of the engine's left-padded batch dropped; rows in step order"


def instantiate(family: str, **values: Any) -> Definition:
    """The family's definition for ``values`` (kept per distinct values by capture)."""
    return cached_instantiate(family, **values)


def token_rows(call: ProbeCall, tensor: torch.Tensor) -> torch.Tensor:
    """The step's real token rows of ``tensor`` (``[batch, columns, *rest]``, or already
    flat ``[tokens, *rest]``), as ``[rows, *rest]`` in step-row order (padding dropped)."""
    step = call.step
    padded = step.padded_tokens or len(step.rows)
    flat = tensor.reshape(padded, *tensor.shape[2:]) if tensor.dim() >= 2 and \
        tensor.shape[0] * tensor.shape[1] == padded and tensor.shape[0] != padded else tensor
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
    if len(columns) > 1 and columns == list(range(columns[0], columns[-1] + 1)):
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


def page_slots(pages: Pages, columns: list[list[int]], rows: list[int], page_size: int,
               device: torch.device) -> Slots:
    """Where every slot of ``pages`` (:func:`pack_pages` of the requests' lengths) comes
    from, for requests whose live tokens are ``columns[i]`` of batch row ``rows[i]`` of a
    ``[batch, heads, width, ...]`` tensor: ``(batch row, column, unused)`` on ``device``,
    one entry per slot (unused slots of last pages repeat a live token and are zeroed).
    A few vectorised ops, once per step: the same for every layer."""
    lengths = torch.tensor([len(c) for c in columns])
    slots = pages.indptr.diff().long() * page_size
    request = torch.repeat_interleave(torch.arange(len(columns)), slots)
    offset = torch.arange(int(slots.sum())) - (torch.cumsum(slots, 0) - slots)[request]
    length = lengths[request]
    valid = offset < length
    within = torch.minimum(offset, (length - 1).clamp(min=0))
    if all(c and c[-1] - c[0] + 1 == len(c) for c in columns):  # one run each (usual)
        column = torch.tensor([c[0] for c in columns])[request] + within
    else:  # an int64 array: torch.tensor of a 16k-int list alone took 3 ms of a step
        flat = array("q", itertools.chain.from_iterable(columns)) or array("q", [0])
        flat_columns = torch.frombuffer(flat, dtype=torch.int64)
        token = (torch.cumsum(lengths, 0) - lengths)[request] + within
        column = flat_columns[token.clamp(max=flat_columns.numel() - 1)]
    unused = None if bool(valid.all()) else (~valid).to(device, non_blocking=True)
    return (torch.tensor(rows)[request].to(device, non_blocking=True),
            column.to(device, non_blocking=True), unused)


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
