"""Where a request sits in a caught call: its batch row (padded engines) or its token rows
(flat engines), and its part of each canonical tensor.

A row's canonical slice is its token rows for token-shaped tensors, its request's entry
for per-request ones; segments of an ``*_indptr`` and a paged cache's pages are followed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from enginetap.core.context import Step

__all__ = ["Layout", "common_rows", "pick_slice", "request_inputs"]


@dataclass
class Layout:
    """Which step rows each batch row of a padded call holds, in step order."""

    batch_rows: list[int]
    rows: list[list[int]]
    columns: list[list[int]]
    keys: list[str]
    width: int
    """Columns of the padded batch; 0 for an engine that runs flat token rows (vLLM), where
    a request is its rows, contiguous in step order."""

    @classmethod
    def of(cls, step: Step) -> Layout:
        shape = step.extra.get("input_shape")
        if not shape:
            return cls._flat(step)
        width = int(shape[1])
        index = step.rows.token_index or list(range(len(step.rows)))
        order: dict[int, int] = {}
        layout = cls([], [], [], [], width)
        for row, flat in enumerate(index):
            b, column = divmod(flat, width)
            if b not in order:
                order[b] = len(layout.batch_rows)
                layout.batch_rows.append(b)
                layout.rows.append([])
                layout.columns.append([])
                layout.keys.append(step.rows.keys[row])
            layout.rows[order[b]].append(row)
            layout.columns[order[b]].append(column)
        return layout

    @classmethod
    def _flat(cls, step: Step) -> Layout:
        layout = cls([], [], [], [], 0)
        for row, key in enumerate(step.rows.keys):
            if not layout.keys or layout.keys[-1] != key:
                layout.batch_rows.append(row)
                layout.rows.append([])
                layout.keys.append(key)
                layout.columns.append([])
            layout.rows[-1].append(row)
            layout.columns[-1].append(row)
        return layout

    def where(self, j: int) -> str:
        """Request ``j``'s place in the batch, in words."""
        if self.width:
            return f"batch row {self.batch_rows[j]} of {len(self.rows)}"
        rows = self.rows[j]
        return (f"token rows {rows[0]}-{rows[-1]} of {sum(len(r) for r in self.rows)} "
                f"(request {j} of {len(self.rows)})")

    def request(self, key: str) -> int:
        """The index (in step order) of ``key``'s batch row."""
        return self.keys.index(key)

    def slice(self, tensor: Any, j: int, limit: int | None = None) -> torch.Tensor | None:
        """Request ``j``'s part of a canonical tensor: its token rows (the first ``limit``
        of them), or its entry of a per-request tensor; None for tensors shared by the
        batch."""
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            return None
        n_rows = sum(len(r) for r in self.rows)
        if tensor.shape[0] == n_rows and n_rows != len(self.rows):
            return tensor[self.rows[j][:limit]]
        if tensor.shape[0] == len(self.rows):
            return tensor[j:j + 1]
        return None


def common_rows(a: Step, key_a: str, b: Step, key_b: str) -> int:
    """How many leading token rows (in position order) two requests share: same
    positions and token ids (a pair's same-prefix rows; all of one request in two runs)."""
    rows_a = sorted((a.rows.positions[r], a.rows.token_ids[r]) for r in a.rows.rows_of_key(key_a))
    rows_b = sorted((b.rows.positions[r], b.rows.token_ids[r]) for r in b.rows.rows_of_key(key_b))
    n = 0
    while n < min(len(rows_a), len(rows_b)) and rows_a[n] == rows_b[n]:
        n += 1
    return n


def pick_slice(tensor: torch.Tensor, sizes: list[int], p: int) -> torch.Tensor:
    """Pick ``p``'s part of a canonical tensor of a call made of picks of ``sizes``
    canonical rows each: its rows where the tensor is token-shaped, else its entry."""
    total = sum(sizes)
    if tensor.shape[0] == total and total != len(sizes):
        start = sum(sizes[:p])
        return tensor[start:start + sizes[p]]
    return tensor[p:p + 1]


def request_inputs(inputs: dict[str, Any], layout: Layout, j: int,
                   limit: int | None = None) -> dict[str, torch.Tensor]:
    """Request ``j``'s part of every canonical input that has one: row- or
    request-shaped tensors (the first ``limit`` token rows), segments of an ``*_indptr``,
    a paged cache's pages. Page numbers and pointers are layout, not data: left out."""
    n = len(layout.rows)
    ptrs = {name: v for name, v in inputs.items() if name.endswith("_indptr")
            and isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == n + 1}
    out: dict[str, torch.Tensor] = {}
    for name, v in inputs.items():
        if not isinstance(v, torch.Tensor) or name.endswith(("_indptr", "indices")):
            continue
        if v.dim() < 2 and v.is_floating_point():
            continue  # per-head constants (A_log, dt_bias), weights
        part = _segment(v, ptrs, j, limit)
        if part is None and name.endswith("_cache") and "kv_indices" in inputs \
                and "kv_indptr" in ptrs:
            p = ptrs["kv_indptr"]
            part = v[inputs["kv_indices"][int(p[j]):int(p[j + 1])].long()]
        if part is None:
            part = layout.slice(v, j, limit)
        if part is not None:
            out[name] = part
    return out


def _segment(v: torch.Tensor, ptrs: dict[str, torch.Tensor], j: int,
             limit: int | None) -> torch.Tensor | None:
    for p in ptrs.values():
        if v.shape[0] == int(p[-1]) and v.dim() >= 2:
            end = int(p[j + 1]) if limit is None else min(int(p[j + 1]), int(p[j]) + limit)
            return v[int(p[j]):end]
    return None
