"""Cross-rank: checkpoints that tensor parallelism replicates must agree rank to rank.

Under TP every rank holds the full residual stream: a decoder layer's input and output
and the norms' outputs are replicated (all-reduced), while attention, MLP and expert
internals are shards. Rows are aligned by (step, request key, position); a replicated
checkpoint whose hash differs between ranks names the step, checkpoint, request and
position, and the ranks that disagree with rank 0.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from enginetap.tap.files import RankTap, TapRun

__all__ = ["RankMismatch", "REPLICATED", "compare_ranks"]

REPLICATED = re.compile(r"^(L\d+\.(in|out)|(L\d+\.)?[a-z_]*norm\.out)$")
"""Checkpoint names replicated across TP ranks (layer in/out, norm outputs)."""


@dataclass
class RankMismatch:
    step: int
    checkpoint: str
    key: str
    position: int
    ranks: list[int]
    """Ranks whose hash differs from rank 0's."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _table(rank: RankTap) -> dict[tuple[int, str, int], dict[str, str]]:
    """(step, key, position) → {replicated checkpoint: hash}."""
    out: dict[tuple[int, str, int], dict[str, str]] = {}
    for step in rank.steps:
        names = [(c, n) for c, n in enumerate(step.checkpoints) if REPLICATED.match(n)]
        for i, row in enumerate(step.rows):
            out[(step.step, row["key"], row["pos"])] = {n: step.hashes[c][i] for c, n in names}
    return out


def compare_ranks(run: TapRun) -> list[RankMismatch]:
    """Every replicated checkpoint of every aligned row where some rank differs from
    rank 0 (empty for a single-rank run)."""
    if len(run.ranks) < 2:
        return []
    tables = {r: _table(rank) for r, rank in run.ranks.items()}
    base = tables.pop(min(tables))
    found = []
    for where, hashes in sorted(base.items()):
        for name, value in hashes.items():
            differ = [r for r, t in tables.items()
                      if where in t and name in t[where] and t[where][name] != value]
            if differ:
                found.append(RankMismatch(where[0], name, where[1], where[2], differ))
    return found
