"""The culprit of a tap finding: which step, checkpoint and requests ``tap explain`` looks at.

A pair (two same-prefix requests of one run, :func:`~enginetap.tap.analysis.pairs.find_pairs`) or a
diff (one request in two runs, :func:`~enginetap.tap.analysis.diff.diff_runs`) names the first
checkpoint where bytes that should be equal are not. This module picks that finding and
turns it into *sides*: for each of the two things compared, the run to re-run (its
header's ``options.run``), the step and the request key. Analysis only: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from enginetap.tap.analysis.diff import diff_runs
from enginetap.tap.analysis.files import TapError, TapRun, load_run
from enginetap.tap.analysis.pairs import find_pairs

__all__ = ["Culprit", "Side", "find_culprit", "module_of", "recheck", "run_facts_of",
           "tap_options"]


@dataclass(frozen=True)
class Side:
    """One of the two compared things: a request of a run at one step."""

    run: Path
    facts: dict[str, Any]
    """The run's ``options.run`` (engine, model, dtype, batch size, prompts...)."""
    tap: dict[str, Any]
    """The run's other tap options (the re-run records with them)."""
    step: int
    key: str


@dataclass(frozen=True)
class Culprit:
    checkpoint: str
    agreeing_input: str | None
    sides: tuple[Side, Side]
    position: int | None

    @property
    def module(self) -> str:
        return module_of(self.checkpoint)

    def label(self, i: int) -> str:
        """Side ``i`` in words: its request key (and its run's folder when both sides are
        one request in two runs)."""
        side = self.sides[i]
        return side.key if self.sides[0].key != self.sides[1].key else \
            f"{side.key} in {side.run.name}"

    def describe(self) -> str:
        a, b = self.sides
        where = (f"pair {a.key}/{b.key} at step {a.step}" if a.run == b.run else
                 f"request {a.key} at step {a.step} of {a.run} vs step {b.step} of {b.run}")
        agrees = f" (input {self.agreeing_input} agrees)" if self.agreeing_input else ""
        return f"{where}, position {self.position}: first differs at {self.checkpoint}{agrees}"


def module_of(checkpoint: str) -> str:
    """``L3.attn.out`` → ``L3.attn``; ``L1.gdn.state_before`` → ``L1.gdn``; ``L3.out``
    → ``L3``; ``norm.out`` → ``norm``."""
    return checkpoint.split("#")[0].rsplit(".", 1)[0]


def run_facts_of(run: TapRun) -> dict[str, Any]:
    """The header's ``options.run``.

    Raises:
        TapError: the run was recorded without them (armed by hand, or by an enginetap
            before ``tap explain``): its prompts are not known.
    """
    facts = (run.header.get("options") or {}).get("run") or {}
    if not facts.get("prompts") or not facts.get("model"):
        raise TapError(f"{run.root}: the run was recorded without its prompts",
                       "its header has no options.run (armed by hand, or recorded by an "
                       "older enginetap)", "record it again with `enginetap tap run`")
    return facts


def tap_options(run: TapRun) -> dict[str, Any]:
    """The run's tap options but ``run`` and ``file``."""
    options = dict(run.header.get("options") or {})
    return {k: v for k, v in options.items() if k not in ("run", "file")}


def find_culprit(run: TapRun, *, pair: tuple[str, str] | None = None,
                 request: str | None = None, other: TapRun | None = None) -> Culprit:
    """The finding ``tap explain`` explains: ``pair`` (or the first split pair holding
    ``request``, or the first split pair) of ``run``; with ``other``, the first divergence
    of ``request`` (or the first overall) between ``run`` and ``other``.

    Raises:
        TapError: no prompts in a header, or the finding has no culprit (no split pair,
            no divergence, an unknown pair or request).
    """
    facts = run_facts_of(run)
    if other is not None:
        return _diff_culprit(run, facts, other, request)
    pairs = [p for p in find_pairs(run.rank(0)) if p.split]
    if pair is not None:
        wanted = tuple(sorted(pair))
        pairs = [p for p in pairs if p.keys == wanted]
    elif request is not None:
        pairs = [p for p in pairs if request in p.keys]
    if not pairs:
        asked = (f"pair {pair[0]}/{pair[1]}" if pair else f"request {request}" if request
                 else "any pair")
        raise TapError(f"{run.root}: no culprit for {asked}", "no same-prefix pair of it "
                       "split in this run (`enginetap tap report` lists the pairs)",
                       "name a pair that split with --pair A/B, or diff two runs with --diff")
    # the earliest split; among those, the pair sharing the most rows (identical prompts
    # before prompts that only share a first token)
    found = min(pairs, key=lambda p: (p.first_step, -p.rows_compared, p.keys))
    step, checkpoint = found.first_step, found.checkpoint
    assert step is not None and checkpoint is not None  # a split pair has both
    tap = tap_options(run)
    sides = (Side(run.root, facts, tap, step, found.keys[0]),
             Side(run.root, facts, tap, step, found.keys[1]))
    return Culprit(checkpoint, found.agreeing_input, sides, found.position)


def _diff_culprit(run: TapRun, facts: dict[str, Any], other: TapRun,
                  request: str | None) -> Culprit:
    other_facts = run_facts_of(other)
    (diff, *_) = diff_runs(run, other)
    found = diff.per_request.get(request) if request is not None else diff.first
    if found is None:
        asked = f"request {request}" if request else "any request"
        raise TapError(f"{run.root} vs {other.root}: no culprit for {asked}",
                       "no aligned row of it diverged between the runs (`enginetap tap "
                       "diff` lists them)", "name a request that diverged with --request")
    sides = (Side(run.root, facts, tap_options(run), found.step_a, found.key),
             Side(other.root, other_facts, tap_options(other), found.step_b, found.key))
    return Culprit(found.checkpoint, None, sides, found.position)


def recheck(culprit: Culprit, rerun_a: Path, rerun_b: Path | None = None) -> tuple[bool, str]:
    """Whether the re-run(s) split the same way at the same step and checkpoint, and a line
    saying what they did."""
    a, b = culprit.sides
    first = load_run(rerun_a)
    if rerun_b is None:
        keys = tuple(sorted((a.key, b.key)))
        pair = next((p for p in find_pairs(first.rank(0)) if p.keys == keys), None)
        if pair is None or not pair.split:
            return False, f"the re-run did not split {a.key}/{b.key}"
        found = (pair.first_step, pair.checkpoint)
    else:
        (diff, *_) = diff_runs(first, load_run(rerun_b))
        divergence = diff.per_request.get(a.key)
        if divergence is None:
            return False, f"the re-runs did not diverge on {a.key}"
        found = (divergence.step_a, divergence.checkpoint)
    same = found == (a.step, culprit.checkpoint)
    return same, (f"the re-run split again at step {found[0]} {found[1]}" + (
        "" if same else f" (the finding: step {a.step} {culprit.checkpoint})"))
