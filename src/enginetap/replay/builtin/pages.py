"""Which cache slots each request attends, for the attention adapters.

A slot is ``page * page_size + offset``: a paged cache ``[num_pages, page_size, ...]``
flattened to ``[num_pages * page_size, ...]``. FlashInfer-style page lists (``kv_indptr``,
``kv_indices``, ``kv_last_page_len``) and per-row index lists become either the slot list of
one request (gathered, for SDPA) or a dense ``[rows, num_slots]`` bool mask (for flex).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch

__all__ = ["LOG2", "PageList", "paged_decode", "request_slots", "slot_mask", "sparse_mask"]

LOG2 = math.log(2.0)


class PageList(NamedTuple):
    """A FlashInfer-style page list of a batch and the cache's page size."""

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    page_size: int


def paged_decode(definition: Any, attend: Callable[..., tuple[torch.Tensor, torch.Tensor]]
                 ) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """A ``gqa_paged_decode`` adapter: ``run(q, k_cache, v_cache, kv_indptr, kv_indices,
    kv_last_page_len, sm_scale)`` calls ``attend(q, k_slots, v_slots, pages, scale)`` with
    the caches flattened to slots ``[num_pages * page_size, num_kv_heads, head_dim]``."""
    page_size = definition.const_axes["page_size"]

    def run(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor,
            sm_scale: Any) -> tuple[torch.Tensor, torch.Tensor]:
        pages = PageList(kv_indptr, kv_indices, kv_last_page_len, page_size)
        return attend(q, k_cache.flatten(0, 1), v_cache.flatten(0, 1), pages, float(sm_scale))

    return run


def request_slots(kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                  kv_last_page_len: torch.Tensor, page_size: int) -> list[torch.Tensor]:
    """Per request, its attended slots in order (empty for a request without pages)."""
    import torch

    indptr, last = kv_indptr.tolist(), kv_last_page_len.tolist()
    offsets = torch.arange(page_size, device=kv_indices.device)
    slots = []
    for b in range(len(indptr) - 1):
        pages = kv_indices[indptr[b]:indptr[b + 1]].to(torch.long)
        every = (pages[:, None] * page_size + offsets).flatten()
        slots.append(every[: max(0, (pages.numel() - 1) * page_size + last[b])])
    return slots


def slot_mask(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor,
              page_size: int, num_slots: int) -> torch.Tensor:
    """``[requests, num_slots]``: True where request b attends the slot."""
    import torch

    slots = request_slots(kv_indptr, kv_indices, kv_last_page_len, page_size)
    mask = torch.zeros(len(slots), num_slots, dtype=torch.bool, device=kv_indices.device)
    for b, chosen in enumerate(slots):
        mask[b, chosen] = True
    return mask


def sparse_mask(indices: torch.Tensor, valid: torch.Tensor, num_slots: int) -> torch.Tensor:
    """``[*indices.shape[:-1], num_slots]``: True at each row's valid indices."""
    import torch

    mask = torch.zeros(*indices.shape[:-1], num_slots + 1, dtype=torch.bool,
                       device=indices.device)
    # Invalid entries go to a spare last column, dropped after the scatter.
    target = torch.where(valid, indices.long(), torch.full_like(indices, num_slots).long())
    mask.scatter_(-1, target, True)
    return mask[..., :num_slots]
