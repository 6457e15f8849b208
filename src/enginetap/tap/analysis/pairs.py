"""Pairs: rows of different requests at the same position with the same token prefix.

Such rows computed the same function of the same tokens, so a bitwise-deterministic
engine gives them identical bytes at every checkpoint. For each pair of requests this
finds the first step where their rows split, the first checkpoint (in execution order)
that differs at that step, and the culprit: that checkpoint, whose input (its module's
recorded ``.in``, else the checkpoint before it) still agrees. Sampler findings tell a
tie flip (top-1/top-2 gap below ``tie_gap``) from a confident flip.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

from enginetap.tap.compare import PER_REQUEST, comparable, compared, last_of_request
from enginetap.tap.analysis.files import RankTap, StepRecord

__all__ = ["PairFinding", "PairSummary", "SamplerFinding", "SamplerSplit", "SplitFinding",
           "find_pairs", "layer_of", "pair_splits", "sampler_findings", "sampler_splits"]


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
    """Every pair of requests that shared a (position, token prefix) in some step.

    One object per pair of requests: for questions about a few named requests. Reports
    over whole runs use :func:`pair_splits`, whose memory grows with rows only."""
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
    """Same-prefix pairs that sampled different tokens, each told tie flip or confident
    (one object per pair: reports use :func:`sampler_splits`)."""
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


# The report's view: memory and time grow with rows, never with pairs of rows. Same-prefix
# rows of one step and position are split into classes of rows that agree, checkpoint by
# checkpoint in execution order; a class that splits is one finding however many row
# pairs it holds. A recurrent state is compared only between requests' last rows that had
# computed as many tokens (:func:`~enginetap.tap.compare.comparable`), so those rows are
# refined once more, per such stratum, over every checkpoint.

_SHOWN = 3
"""Request keys named per class of a split (the class's size says how many more)."""


@dataclass
class SplitFinding:
    """Same-prefix rows of one step and position that agreed up to ``checkpoint`` and split
    there into ``classes`` (rows that still agree with each other)."""

    step: int
    position: int
    checkpoint: str
    agreeing_input: str
    classes: list[tuple[int, list[str]]]
    """Per class: its number of rows (one per request) and its first request keys."""
    pairs: int
    """Row pairs (of different classes) whose first difference is this checkpoint."""

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "position": self.position, "culprit": self.checkpoint,
                "agreeing_input": self.agreeing_input, "pairs": self.pairs,
                "classes": [{"rows": n, "keys": keys} for n, keys in self.classes]}

    def describe(self, limit: int = 6) -> str:
        """The classes, ``|`` between them: their first keys, ``(+n)`` for the rest (at
        most ``limit`` classes, then how many more)."""
        said = " | ".join(", ".join(keys) + (f" (+{n - len(keys)})" if n > len(keys) else "")
                          for n, keys in self.classes[:limit])
        more = len(self.classes) - limit
        return said + (f" | {more} more class(es)" if more > 0 else "")


@dataclass
class PairSummary:
    """Every same-prefix row pair of one rank, counted; where they split, by class."""

    pairs_compared: int = 0
    pairs_split: int = 0
    splits: list[SplitFinding] = field(default_factory=list)
    cells: Counter = field(default_factory=Counter)
    """(layer, step) → row pairs whose first difference at that step is there."""


def _per_request_kind(name: str) -> str:
    base = name.split("#")[0]
    if base.endswith((".state_before", ".conv_before")):
        return "before"
    return "after" if base.endswith(PER_REQUEST) else ""


def _cross(parts: list[list[int]], strata: dict[int, Any] | None) -> int:
    """Pairs of rows in different parts, less those within one stratum (counted when
    the stratum is refined on its own)."""
    def pairs(sizes: list[int]) -> int:
        total = sum(sizes)
        return (total * total - sum(s * s for s in sizes)) // 2

    count = pairs([len(p) for p in parts])
    if strata:
        per: dict[Any, list[int]] = {}
        for p in parts:
            sizes: Counter = Counter(strata[i] for i in p if i in strata)
            for key, n in sizes.items():
                per.setdefault(key, []).append(n)
        count -= sum(pairs(sizes) for sizes in per.values())
    return count


def _refine(step: StepRecord, rows: list[int], checkpoints: list[int],
            strata: dict[int, Any] | None, out: PairSummary) -> None:
    classes = [rows]
    for c in checkpoints:
        column, kept = step.hashes[c], []
        for members in classes:
            parts: dict[str, list[int]] = {}
            for i in members:
                parts.setdefault(column[i], []).append(i)
            split = list(parts.values())
            if len(split) > 1:
                _record(step, c, split, _cross(split, strata), out)
            kept.extend(p for p in split if len(p) > 1)
        classes = kept
        if not classes:
            return


def _record(step: StepRecord, c: int, parts: list[list[int]], pairs: int,
            out: PairSummary) -> None:
    if not pairs:
        return
    name = step.checkpoints[c]
    classes = sorted((len(p), sorted(step.rows[i]["key"] for i in p)[:_SHOWN]) for p in parts)
    classes.sort(key=lambda x: x[1])
    out.splits.append(SplitFinding(step.step, step.rows[parts[0][0]]["pos"], name,
                                   _agreeing_input(step, c), classes, pairs))
    out.pairs_split += pairs
    out.cells[(layer_of(name), step.step)] += pairs


def pair_splits(rank: RankTap) -> PairSummary:
    """Every same-prefix row pair of ``rank`` counted and, where rows split, the classes
    they split into (one finding per split class, not per pair)."""
    out = PairSummary()
    for step in rank.steps:
        last = last_of_request(step.rows)
        for group in _groups(step):
            rows = list({step.rows[i]["key"]: i for i in reversed(group)}.values())[::-1]
            out.pairs_compared += len(rows) * (len(rows) - 1) // 2
            position = step.rows[rows[0]]["pos"]
            names = [(c, n, _per_request_kind(n)) for c, n in enumerate(step.checkpoints)
                     if compared(n, position)]
            strata: dict[int, Any] = {i: step.rows[i]["computed_host"] for i in rows
                                      if i in last}
            _refine(step, rows, [c for c, _, kind in names if not kind], strata, out)
            by_stratum: dict[Any, list[int]] = {}
            for i, host in strata.items():
                by_stratum.setdefault(host, []).append(i)
            for host, members in by_stratum.items():
                if len(members) > 1:
                    wanted = [c for c, _, kind in names if kind != "before" or host != 0]
                    _refine(step, members, wanted, None, out)
    out.splits.sort(key=lambda s: (s.step, s.position, s.checkpoint))
    return out


@dataclass
class SamplerSplit:
    """Same-prefix requests of one step that sampled different tokens: the token classes."""

    step: int
    tokens: list[tuple[int, int, list[str]]]
    """Per token: how many requests sampled it and the first of their keys."""
    min_gap: float
    kind: str
    """``tie flip`` (some request's top-1/top-2 gap below the tie gap) or ``confident flip``."""

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "min_gap": self.min_gap, "kind": self.kind,
                "tokens": [{"token": t, "requests": n, "keys": k} for t, n, k in self.tokens]}


def sampler_splits(rank: RankTap, tie_gap: float = 1e-3) -> list[SamplerSplit]:
    """Per step and same-prefix group of requests' last rows: the tokens they sampled,
    when they differ (one finding per group, not per pair)."""
    out = []
    for step in rank.steps:
        last = _last_rows(step)
        for group in _groups(step):
            members = {step.rows[i]["key"] for i in group}
            by_token: dict[int, list[str]] = {}
            gaps = []
            for key in sorted(members):
                i = last.get(key)
                if i is None or i not in group:
                    continue
                row = step.rows[i]
                token = step.sampled.get(row["request_id"], step.sampler[i]["argmax"])
                by_token.setdefault(token, []).append(key)
                gaps.append(step.sampler[i]["gap"])
            if len(by_token) > 1:
                tokens = sorted(((t, len(k), k[:_SHOWN]) for t, k in by_token.items()),
                                key=lambda x: x[2])
                kind = "tie flip" if min(gaps) < tie_gap else "confident flip"
                out.append(SamplerSplit(step.step, tokens, min(gaps), kind))
    return out
