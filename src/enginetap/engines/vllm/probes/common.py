"""Helpers every vLLM CPU probe shares: dtypes, TP reconstruction, paged-cache compaction.

Under tensor parallelism every rank runs its shard of the operator; the adapters rebuild
the logical operator on rank 0 with :func:`~enginetap.core.ranks.gather_shards`. Every rank
calls the same gathers in the same order (the runtime makes the same selection decision on
every rank), only rank 0 gets tensors back, and only rank 0 writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from enginetap.capture.probe import Extracted, ProbeCall
from enginetap.core.ranks import gather_shards
from enginetap.definitions import instantiate

__all__ = ["DTYPES", "Pages", "compact_pages", "gather", "instantiate", "is_writer",
           "other_rank", "summed", "tp_world"]

DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def tp_world(call: ProbeCall) -> int:
    return max(1, int(call.step.world_size))


def is_writer(call: ProbeCall) -> bool:
    return call.step.rank == 0


def gather(call: ProbeCall, tensor: torch.Tensor, dim: int) -> torch.Tensor | None:
    """The logical tensor from every rank's shard along ``dim`` (None off rank 0)."""
    if tp_world(call) == 1:
        return tensor
    return gather_shards(tensor.contiguous(), dim)


def summed(call: ProbeCall, partial: torch.Tensor) -> torch.Tensor | None:
    """The sum over ranks of a partial result (the all-reduce the engine does next),
    in float32, on rank 0; ``partial`` itself without TP."""
    if tp_world(call) == 1:
        return partial
    stacked = gather_shards(partial.unsqueeze(0).contiguous(), 0)
    return None if stacked is None else stacked.float().sum(dim=0)


def other_rank() -> Extracted:
    """What a rank other than 0 returns once it took part in every gather."""
    return Extracted({}, {}, ["rank > 0: shards sent to rank 0"])


@dataclass(frozen=True)
class Pages:
    """The live pages of the captured requests, renumbered 0..n-1 in first-use order."""

    physical: list[int]
    """Original physical page id of each compacted page."""
    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor

    def note(self, what: str) -> str:
        return (f"{what}: compacted to the {len(self.physical)} live pages of the captured "
                f"requests, renumbered 0..{len(self.physical) - 1}; original physical page "
                f"ids in order: {self.physical}")


def compact_pages(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> Pages:
    """Pages each request reads (``block_table`` rows, ``seq_lens`` tokens), compacted."""
    table, lens = block_table.cpu().tolist(), [int(x) for x in seq_lens.cpu().tolist()]
    physical: list[int] = []
    renumber: dict[int, int] = {}
    indices, indptr, last = [], [0], []
    for row, length in zip(table, lens):
        count = -(-length // page_size)
        for page in row[:count]:
            if page not in renumber:
                renumber[page] = len(physical)
                physical.append(int(page))
            indices.append(renumber[page])
        indptr.append(len(indices))
        last.append(length - (count - 1) * page_size if count else 0)
    as_int = {"dtype": torch.int32}
    return Pages(physical, torch.tensor(indptr, **as_int), torch.tensor(indices, **as_int),
                 torch.tensor(last, **as_int))
