"""Diffing two runs of the same prompts: rows aligned by (request key, position).

Row indices, step numbers and batch composition differ between runs (batch 1 vs 8,
another configuration, another engine version); the request key and the position do
not. Each aligned row is compared checkpoint by checkpoint in run A's execution order;
rows whose token prefixes differ (the runs generated different tokens earlier) are
counted, not compared. Prompt rows (prefill in both) with different prefixes mean the
runs had different prompts: that is refused.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from enginetap.tap.analysis.crossrank import merge_ranks
from enginetap.tap.analysis.files import RankTap, StepRecord, TapError, TapRun
from enginetap.tap.analysis.pairs import layer_of
from enginetap.tap.compare import comparable, last_of_request

__all__ = ["Divergence", "RunDiff", "check_comparable", "diff_ranks", "diff_runs",
           "nothing_compared"]

Located = tuple[StepRecord, int, bool]
"""A row: its step, its index there, whether it is its request's last row there."""


@dataclass
class Divergence:
    key: str
    position: int
    step_a: int
    step_b: int
    checkpoint: str

    @property
    def layer(self) -> str:
        return layer_of(self.checkpoint)

    @property
    def sublayer(self) -> str:
        """The checkpoint within its layer (``attn.out`` of ``L3.attn.out``)."""
        layer = self.layer
        return self.checkpoint[len(layer) + 1:] if layer != "model" else self.checkpoint

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "position": self.position, "step_a": self.step_a,
                "step_b": self.step_b, "layer": self.layer, "sublayer": self.sublayer,
                "checkpoint": self.checkpoint}


@dataclass
class RunDiff:
    rank: int
    rows_compared: int = 0
    rows_diverged: int = 0
    rows_token_diverged: int = 0
    checkpoints_compared: int = 0
    """Checkpoint names both runs recorded (compared on the aligned rows)."""
    only_a: int = 0
    only_b: int = 0
    per_request: dict[str, Divergence] = field(default_factory=dict)
    """The first diverging row (lowest position) of every request that diverged."""
    first_token_split: dict[str, int] = field(default_factory=dict)
    """Per request: the first position whose token prefix differs between the runs."""
    by_checkpoint: Counter = field(default_factory=Counter)
    cells: Counter = field(default_factory=Counter)
    """(layer, step in run A) → aligned rows whose first divergence is there."""
    first: Divergence | None = None
    merged: tuple[int, int] | None = None
    """Rank counts of runs A and B where they differed (both merged before comparing)."""

    @property
    def diverged(self) -> bool:
        return bool(self.rows_diverged or self.rows_token_diverged)

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "merged": self.merged, "rows_compared": self.rows_compared,
                "rows_diverged": self.rows_diverged,
                "rows_token_diverged": self.rows_token_diverged,
                "checkpoints_compared": self.checkpoints_compared,
                "only_a": self.only_a, "only_b": self.only_b,
                "first": None if self.first is None else self.first.to_json(),
                "per_request": {k: d.to_json() for k, d in sorted(self.per_request.items())},
                "first_token_split": dict(sorted(self.first_token_split.items())),
                "by_checkpoint": dict(self.by_checkpoint.most_common())}


def _index(rank: RankTap) -> dict[tuple[str, int], Located]:
    rows: dict[tuple[str, int], Located] = {}
    for step in rank.steps:
        last = last_of_request(step.rows)
        for i, row in enumerate(step.rows):
            rows.setdefault((row["key"], row["pos"]), (step, i, i in last))
    return rows


def _refuse_prompts(rank_a: RankTap, rank_b: RankTap, key: tuple[str, int],
                    a: Located, b: Located) -> None:
    raise TapError(f"{rank_a.path}:{a[0].line} and {rank_b.path}:{b[0].line}: the runs had "
                   f"different prompts", f"request {key[0]!r} has other prompt tokens up to "
                   f"position {key[1]}", "diff two runs of the same prompts")


def _first_difference(a: Located, b: Located) -> str | None:
    (sa, i, last_a), (sb, j, last_b) = a, b
    both_last = last_a and last_b
    where = {name: c for c, name in enumerate(sb.checkpoints)}
    for c, name in enumerate(sa.checkpoints):
        other = where.get(name)
        if other is None:
            continue
        ha, hb = sa.hashes[c][i], sb.hashes[other][j]
        if ha is not None and hb is not None and ha != hb \
                and comparable(name, sa.rows[i], sb.rows[j], both_last):
            return name
    return None


def diff_ranks(rank_a: RankTap, rank_b: RankTap, rank: int = 0) -> RunDiff:
    """Raises: TapError: prompt rows of one request differ (different prompts)."""
    index_a, index_b = _index(rank_a), _index(rank_b)
    result = RunDiff(rank, only_a=len(index_a.keys() - index_b.keys()),
                     only_b=len(index_b.keys() - index_a.keys()))
    best: tuple[int, int] | None = None
    for key in sorted(index_a.keys() & index_b.keys()):
        a, b = index_a[key], index_b[key]
        ra, rb = a[0].rows[a[1]], b[0].rows[b[1]]
        if ra["prefix"] != rb["prefix"]:
            if a[0].mode == "prefill" and b[0].mode == "prefill":
                _refuse_prompts(rank_a, rank_b, key, a, b)
            result.rows_token_diverged += 1
            result.first_token_split.setdefault(key[0], key[1])
            continue
        result.rows_compared += 1
        name = _first_difference(a, b)
        if name is None:
            continue
        found = Divergence(key[0], key[1], a[0].step, b[0].step, name)
        result.rows_diverged += 1
        result.by_checkpoint[name] += 1
        result.cells[(layer_of(name), a[0].step)] += 1
        result.per_request.setdefault(key[0], found)
        order = (found.step_a, a[0].checkpoints.index(name))
        if best is None or order < best:
            best, result.first = order, found
    if result.rows_compared:
        result.checkpoints_compared = len(_names(rank_a) & _names(rank_b))
    return result


def _names(rank: RankTap) -> set[str]:
    return {name for step in rank.steps for name in step.checkpoints}


def _listed(values: set[str]) -> str:
    shown = sorted(values)[:4]
    return ", ".join(shown) + (f" and {len(values) - 4} more" if len(values) > 4 else "") \
        if values else "none"


def nothing_compared(run_a: TapRun, run_b: TapRun, diffs: list[RunDiff]) -> str | None:
    """Why the diff compared nothing (no aligned row, or no checkpoint both recorded), or
    None when it compared something: a diff of nothing must not read "no divergence"."""
    if any(d.rows_compared and d.checkpoints_compared or d.rows_token_diverged for d in diffs):
        return None
    keys = [{row["key"] for rank in run.ranks.values() for step in rank.steps
             for row in step.rows} for run in (run_a, run_b)]
    if not keys[0] & keys[1]:
        return (f"the runs share no request key (A: {_listed(keys[0])}; B: "
                f"{_listed(keys[1])})")
    if not any(d.rows_compared for d in diffs):
        return "the runs share request keys but no (request, position) row"
    names = [{n for rank in run.ranks.values() for n in _names(rank)} for run in (run_a, run_b)]
    return (f"the runs share no checkpoint name (A: {_listed(names[0])}; B: "
            f"{_listed(names[1])})")


def _models(run: TapRun) -> list[tuple[str, str]]:
    return sorted((str(m.get("model_type")), str(m.get("layers")))
                  for m in run.header.get("models") or [])


def _dtypes(run: TapRun) -> list[str]:
    return sorted(str(m.get("dtype")).removeprefix("torch.")
                  for m in run.header.get("models") or [])


def _mode(run: TapRun) -> str:
    compiled = run.header.get("compiled")
    return f"compiled ({compiled})" if compiled else "eager"


def check_comparable(run_a: TapRun, run_b: TapRun) -> list[str]:
    """Warnings about two runs that can be diffed but differ in what they ran (dtypes, the
    engine).

    Raises:
        TapError: the runs are of different models (model type or layer count).
    """
    models = _models(run_a), _models(run_b)
    if models[0] and models[1] and models[0] != models[1]:
        said = [", ".join(f"{t} ({n} layers)" for t, n in m) for m in models]
        raise TapError(f"{run_a.root} and {run_b.root} are runs of different models",
                       f"A ran {said[0]}, B ran {said[1]}: their checkpoints differ by "
                       "construction", "diff two runs of the same model")
    warnings = []
    dtypes = _dtypes(run_a), _dtypes(run_b)
    if dtypes[0] != dtypes[1]:
        warnings.append(f"run A computes in {', '.join(dtypes[0]) or 'an unrecorded dtype'}, "
                        f"run B in {', '.join(dtypes[1]) or 'an unrecorded dtype'}: every "
                        "checkpoint is expected to differ; diff runs of one dtype to find "
                        "where they diverge")
    if not models[0] or not models[1]:
        warnings.append("a run's header names no model: that both ran the same model is "
                        "not checked")
    modes = [_mode(r) for r in (run_a, run_b)]
    if modes[0] != modes[1]:
        warnings.append(f"A ran {modes[0]}, B ran {modes[1]}: a compiler fuses and rounds "
                        "differently from eager kernels (vLLM compiled also runs its custom-op "
                        "layers' torch code), so checkpoints may differ from the first "
                        "compiled sublayer on")
    for label, run in (("A", run_a), ("B", run_b)):
        if run.header.get("not_placed"):
            warnings.append(f"run {label} could not place {_listed(set(run.header['not_placed']))}"
                            " under compile: not compared")
    engines = [f"{r.header.get('engine')} ({r.header.get('engine_version')})"
               for r in (run_a, run_b)]
    if engines[0] != engines[1]:
        warnings.append(f"the runs are of different engines: A {engines[0]}, B {engines[1]}")
    return warnings


def diff_runs(run_a: TapRun, run_b: TapRun) -> list[RunDiff]:
    """One :class:`RunDiff` per rank both runs have (rank to rank); runs of different
    rank counts (TP sizes) are compared once, each merged
    (:func:`~enginetap.tap.analysis.crossrank.merge_ranks`: only checkpoints whole on every rank).

    Raises:
        TapError: the runs had different prompts, or share no rank.
    """
    if len(run_a.ranks) != len(run_b.ranks):
        merged = diff_ranks(merge_ranks(run_a), merge_ranks(run_b), 0)
        merged.merged = (len(run_a.ranks), len(run_b.ranks))
        return [merged]
    shared = sorted(run_a.ranks.keys() & run_b.ranks.keys())
    if not shared:
        raise TapError(f"{run_a.root} and {run_b.root} share no rank",
                       "each run's files name their ranks", "diff runs of the same ranks")
    return [diff_ranks(run_a.ranks[r], run_b.ranks[r], r) for r in shared]
