"""Forwards whose token rows are split across ranks, seen whole by consumers that need it.

A patch that keeps a forward's token rows split across the ranks of a group (sequence
parallelism) installs a joiner while such a forward runs. A consumer that fingerprints
every token row (tap) and meets a tensor whose leading dimension is not the step's row
count asks :func:`join_rows`: it gets every rank's rows in order, or None where the tensor
is not one of the patch's shards. A joiner is a collective: consumers must call it for the
same tensors in the same order on every rank, as they do when their decisions depend on
the step only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Joiner", "join_rows", "set_row_joiner"]

Joiner = Callable[[Any, int], Any]
"""``joiner(tensor, rows)``: the ``rows`` rows ``tensor`` is this rank's part of, or None."""

_JOINER: Joiner | None = None


def set_row_joiner(joiner: Joiner | None) -> Joiner | None:
    """Make ``joiner`` current (None: none); returns the one it replaces."""
    global _JOINER
    previous, _JOINER = _JOINER, joiner
    return previous


def join_rows(tensor: Any, rows: int) -> Any:
    """Every rank's rows of ``tensor`` when it is a row shard of a ``rows``-row forward in
    progress, else None."""
    return None if _JOINER is None else _JOINER(tensor, rows)
