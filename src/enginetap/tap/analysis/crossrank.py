"""Cross-rank: checkpoints that tensor parallelism replicates must agree rank to rank.

Under TP every rank holds the full residual stream: a decoder layer's input and output,
the norms' outputs and the all-reduced outputs of attention, gated-delta, MLP and MoE
blocks are replicated, while their internals (kernel outputs, KV rows, recurrent state,
shared-expert partial sums) are shards. Rows are aligned by (step, request key,
position); a replicated checkpoint whose hash differs between ranks names the step,
checkpoint, request and position, and the ranks that disagree with rank 0.

:func:`merge_ranks` gives the view of a multi-rank run that runs of other TP sizes are
compared with: only what is whole on every rank.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace
from typing import Any

from enginetap.tap.analysis.files import RankTap, StepRecord, TapRun

__all__ = ["RankMismatch", "REPLICATED", "compare_ranks", "merge_ranks"]

REPLICATED = re.compile(r"^(L\d+\.(in|out\d*|(attn|gdn|mlp|moe)\.out)|(L\d+\.)?[a-z_]*norm\.out)$")
"""Checkpoint names replicated across TP ranks (layer in/out, block outputs, norms)."""


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


def merge_ranks(run: TapRun) -> RankTap:
    """One rank's view of a run for comparing runs of other TP sizes: rank 0's records,
    where a checkpoint's hash of a row is kept only if every rank recorded the same
    (the value is whole on every rank); shards (which differ rank to rank) become None.
    A single-rank run is returned as it is."""
    if len(run.ranks) < 2:
        return run.rank(min(run.ranks))
    base = run.rank(min(run.ranks))
    others = [{(s.step): s for s in rank.steps} for r, rank in run.ranks.items()
              if r != min(run.ranks)]
    steps = [_merged_step(step, [o.get(step.step) for o in others]) for step in base.steps]
    return RankTap(base.path, base.header, steps)


def _merged_step(step: StepRecord, others: list[StepRecord | None]) -> StepRecord:
    where = [(o, {(r["key"], r["pos"]): i for i, r in enumerate(o.rows)},
              {n: c for c, n in enumerate(o.checkpoints)}) for o in others if o is not None]
    hashes = []
    for c, name in enumerate(step.checkpoints):
        kept: list[Any] = []
        for i, row in enumerate(step.rows):
            value = step.hashes[c][i]
            for other, rows, names in where:
                j, k = rows.get((row["key"], row["pos"])), names.get(name)
                if len(where) < len(others) or j is None or k is None \
                        or other.hashes[k][j] != value:
                    value = None
                    break
            kept.append(value)
        hashes.append(kept)
    return replace(step, hashes=hashes)
