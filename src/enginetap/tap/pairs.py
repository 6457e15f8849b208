"""Pairs: rows of different requests at the same position with the same token prefix.

Such rows computed the same function of the same tokens, so a bitwise-deterministic
engine gives them identical bytes at every checkpoint. For each pair of requests this
finds the first step where their rows split, the first checkpoint (in execution order)
that differs at that step, and the culprit: that checkpoint, whose input (its module's
recorded ``.in``, else the checkpoint before it) still agrees. Sampler findings tell a
tie flip (top-1/top-2 gap below ``tie_gap``) from a confident flip.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

from enginetap.tap.compare import comparable, last_of_request
from enginetap.tap.files import RankTap, StepRecord

__all__ = ["PairFinding", "SamplerFinding", "find_pairs", "layer_of", "sampler_findings"]


@dataclass
class PairFinding:
    """Two requests whose same-prefix rows were compared, and where they first split."""

    keys: tuple[str, str]
    rows_compared: int = 0
    first_step: int | None = None
    position: int | None = None
    checkpoint: str | None = None
    agreeing_input: str | None = None
    splits: list[tuple[int, str]] = field(default_factory=list)
    """(step, first differing checkpoint) of every step where the pair differed."""

    @property
    def split(self) -> bool:
        return self.first_step is not None

    def to_json(self) -> dict[str, Any]:
        return {"keys": list(self.keys), "rows_compared": self.rows_compared,
                "first_step": self.first_step, "position": self.position,
                "culprit": self.checkpoint, "agreeing_input": self.agreeing_input,
                "split_steps": len(self.splits)}


def layer_of(checkpoint: str) -> str:
    """``L3.attn.out`` → ``L3``; names outside layers (``norm.out``) → ``model``."""
    head = checkpoint.split(".", 1)[0]
    return head if head[:1] == "L" and head[1:].isdigit() else "model"


def _first_difference(step: StepRecord, i: int, j: int, last: set[int]) -> int | None:
    a, b = step.rows[i], step.rows[j]
    both_last = i in last and j in last
    for c, name in enumerate(step.checkpoints):
        if step.hashes[c][i] != step.hashes[c][j] and comparable(name, a, b, both_last):
            return c
    return None


def _agreeing_input(step: StepRecord, c: int) -> str:
    name = step.checkpoints[c]
    module = name.rsplit(".", 1)[0]
    own = f"{module}.in"
    if own in step.checkpoints[:c]:
        return own
    return step.checkpoints[c - 1] if c else "token ids"


def _groups(step: StepRecord) -> list[list[int]]:
    groups: dict[tuple[int, str], list[int]] = {}
    for i, row in enumerate(step.rows):
        if row.get("prefix") is not None:
            groups.setdefault((row["pos"], row["prefix"]), []).append(i)
    return [g for g in groups.values() if len({step.rows[i]["key"] for i in g}) > 1]


def find_pairs(rank: RankTap) -> list[PairFinding]:
    """Every pair of requests that shared a (position, token prefix) in some step."""
    found: dict[tuple[str, str], PairFinding] = {}
    for step in rank.steps:
        earliest: dict[tuple[str, str], tuple[int, int, int]] = {}
        last = last_of_request(step.rows)
        for group in _groups(step):
            for i, j in combinations(group, 2):
                a, b = step.rows[i]["key"], step.rows[j]["key"]
                if a == b:
                    continue
                keys = (a, b) if a < b else (b, a)
                pair = found.setdefault(keys, PairFinding(keys))
                pair.rows_compared += 1
                c = _first_difference(step, i, j, last)
                # all rows of a step run each checkpoint together: the pair's first
                # difference this step is the earliest checkpoint over its rows
                if c is not None and (keys not in earliest or c < earliest[keys][0]):
                    earliest[keys] = (c, step.rows[i]["pos"], i)
        for keys, (c, position, _) in earliest.items():
            _split(found[keys], step, c, position)
    return sorted(found.values(), key=lambda p: (p.first_step is None, p.first_step or 0, p.keys))


def _split(pair: PairFinding, step: StepRecord, c: int, position: int) -> None:
    pair.splits.append((step.step, step.checkpoints[c]))
    if pair.first_step is None:
        pair.first_step, pair.position = step.step, position
        pair.checkpoint, pair.agreeing_input = step.checkpoints[c], _agreeing_input(step, c)


@dataclass
class SamplerFinding:
    """Two same-prefix requests that sampled different tokens at one step."""

    step: int
    keys: tuple[str, str]
    tokens: tuple[int, int]
    gaps: tuple[float, float]
    kind: str
    """``tie flip`` (a near tie went the other way) or ``confident flip``."""


def _last_rows(step: StepRecord) -> dict[str, int]:
    # rows of a request are in position order, so its last row is the sampled one
    return {row["key"]: i for i, row in enumerate(step.rows) if i < len(step.sampler)}


def sampler_findings(rank: RankTap, tie_gap: float = 1e-3) -> list[SamplerFinding]:
    """Same-prefix pairs that sampled different tokens, each told tie flip or confident."""
    out = []
    for step in rank.steps:
        last = _last_rows(step)
        for group in _groups(step):
            members = sorted({step.rows[i]["key"] for i in group})
            for a, b in combinations(members, 2):
                if a not in last or b not in last:
                    continue
                ra, rb = step.rows[last[a]], step.rows[last[b]]
                if ra["pos"] != rb["pos"] or ra["prefix"] != rb["prefix"]:
                    continue
                ta = step.sampled.get(ra["request_id"], step.sampler[last[a]]["argmax"])
                tb = step.sampled.get(rb["request_id"], step.sampler[last[b]]["argmax"])
                if ta != tb:
                    gaps = (step.sampler[last[a]]["gap"], step.sampler[last[b]]["gap"])
                    kind = "tie flip" if min(gaps) < tie_gap else "confident flip"
                    out.append(SamplerFinding(step.step, (a, b), (ta, tb), gaps, kind))
    return out
