"""One chunk's sequence-parallel plan: which rows this rank owns and the collectives.

A :class:`Plan` exists only while a model forward runs the sharded path (see
:mod:`.patch`); :func:`current_plan` is how the decoder-layer and all-reduce wrappers learn
it. Every collective goes through the plan, which counts the bytes each one is handed and
the time it took into the chunk's :class:`ChunkRecord`.

Reductions by mode, for a partial sum ``x`` of the chunk's ``rows`` rows:

- ``exact``: all-reduce, keep this rank's rows (the stock engine's bits, by construction);
- ``shard``: reduce-scatter along rows;
- ``comm``: reduce-scatter then all-gather (transport only: nothing stays sharded).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from enginetap.core.rowsplit import Joiner, set_row_joiner
from enginetap.core.tensors import compare_bits, summarize
from enginetap.guard.bits import dump_mismatch

logger = logging.getLogger("enginetap.sp_prefill")

__all__ = ["ChunkRecord", "Plan", "active", "current_plan"]


@dataclass
class ChunkRecord:
    """What one model forward did on this rank: the path, why, and what it moved."""

    step: int
    step_mode: str
    rows: int
    mode: str = ""
    """The patch's mode when the forward ran."""
    path: str = "stock"
    """``sp`` (sharded path served), ``proof`` (first chunk of its shape: both paths ran,
    stock served), ``fallback`` (the proof failed on some rank: stock), ``compare``
    (guard compare mode: both ran, stock served) or ``stock`` (not eligible, see reason)."""
    reason: str = ""
    row_local_rows: int = 0
    """Rows the norms and residual adds of one layer ran on, on this rank."""
    bytes: dict[str, int] = field(default_factory=dict)
    """Bytes of the full tensors handed to each collective, by collective."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall time inside each collective, by collective."""
    mismatches: list[str] = field(default_factory=list)

    def count(self, op: str, nbytes: int, seconds: float) -> None:
        self.bytes[op] = self.bytes.get(op, 0) + nbytes
        self.seconds[op] = self.seconds.get(op, 0.0) + seconds


class _State(threading.local):
    def __init__(self) -> None:
        self.plan: Plan | None = None


_STATE = _State()


def current_plan() -> Plan | None:
    """The plan of the sharded forward in progress on this thread, else None."""
    return _STATE.plan


class active:
    """``with active(plan):`` makes ``plan`` current for one model forward, and its
    :meth:`Plan.join` the row joiner consumers such as tap use on its shards."""

    def __init__(self, plan: Plan) -> None:
        self._plan = plan
        self._old: Plan | None = None
        self._old_joiner: Joiner | None = None

    def __enter__(self) -> Plan:
        self._old, _STATE.plan = _STATE.plan, self._plan
        self._old_joiner = set_row_joiner(self._plan.join)
        return self._plan

    def __exit__(self, *exc: object) -> None:
        _STATE.plan = self._old
        set_row_joiner(self._old_joiner)


@dataclass
class Plan:
    """This rank's part of one sequence-parallel chunk."""

    mode: str
    rows: int
    rank: int
    world: int
    layers: int
    tp: Any
    """vLLM's tensor-parallel ``GroupCoordinator``."""
    record: ChunkRecord | None = None
    compare: bool = False
    dump_dir: Path | None = None
    layer: int = -1
    site: str = ""

    @property
    def shard(self) -> int:
        return self.rows // self.world

    @property
    def sharded(self) -> bool:
        return self.mode in ("shard", "exact")

    def own_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.rank * self.shard:(self.rank + 1) * self.shard]

    def enter_layer(self) -> bool:
        """Advance to the next decoder layer; True when it is the last of the loop."""
        self.layer += 1
        return self.layer == self.layers - 1

    def join(self, tensor: Any, rows: int) -> torch.Tensor | None:
        """Every rank's rows of ``tensor`` if it is this plan's shard (a collective; not
        counted in the record: only debugging consumers call it)."""
        if (not self.sharded or rows != self.rows or not isinstance(tensor, torch.Tensor)
                or tensor.dim() == 0 or tensor.shape[0] != self.shard):
            return None
        return self.tp.all_gather(tensor.contiguous(), dim=0)

    # ------------------------------------------------------------------ collectives
    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's rows, in rank order (all-gather along rows)."""
        start = time.perf_counter()
        out = self.tp.all_gather(x.contiguous(), dim=0)
        self._count("all_gather", out, start)
        return out

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The reduction of a row-parallel projection's partial sums, per the mode."""
        reference = self.tp.all_reduce(x.clone()) if self.compare else None
        if self.mode == "exact":
            start = time.perf_counter()
            full = self.tp.all_reduce(x)
            self._count("all_reduce", full, start)
            out = self.own_rows(full)
        else:
            start = time.perf_counter()
            out = self.tp.reduce_scatter(x.contiguous(), dim=0)
            self._count("reduce_scatter", x, start)
            if self.mode == "comm":
                out = self.gather(out)
        if reference is not None:
            self._check(out, reference if self.mode == "comm" else self.own_rows(reference))
        return out

    def _count(self, op: str, tensor: torch.Tensor, start: float) -> None:
        if self.record is not None:
            self.record.count(op, tensor.numel() * tensor.element_size(),
                              time.perf_counter() - start)

    # ------------------------------------------------------------------ debug compare
    def _check(self, ours: torch.Tensor, stock: torch.Tensor) -> None:
        differences = compare_bits([("out", stock)], [("out", ours)])
        if not differences:
            return
        op = f"layer{self.layer}.{self.site}"
        line = f"{op} rows={self.rows} rank={self.rank}: {summarize(differences)}"
        logger.warning("enginetap sp_prefill compare mismatch %s", line)
        if self.record is not None:
            self.record.mismatches.append(line)
        if self.dump_dir is None or op in _DUMPED:
            return
        _DUMPED.add(op)
        try:
            path = dump_mismatch(self.dump_dir, f"sp_prefill-{op}-rank{self.rank}", inputs=[],
                                 stock=[("out", stock)], patched=[("out", ours)],
                                 differences=differences,
                                 meta={"op": op, "rows": str(self.rows), "rank": str(self.rank),
                                       "mode": self.mode})
        except OSError as exc:
            logger.error("enginetap sp_prefill: cannot dump the mismatch of %s: %s", op, exc)
            return
        logger.warning("enginetap sp_prefill: first mismatch of %s dumped to %s", op, path)


_DUMPED: set[str] = set()
"""Ops whose first mismatch this process already dumped."""
