"""``enginetap tap report``: what one run's pairs, continuity and sampler say.

:func:`analyse` runs every check over every rank; :func:`summary` renders it for a
terminal and :func:`html_page` as one self-contained page (no external resources): a
layer x step picture of where pairs split, then tables of pairs, continuity, metadata and
sampler findings.
"""

from __future__ import annotations

import html
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from enginetap.tap.continuity import (Violation, check_continuity, check_metadata,
                                      metadata_checked)
from enginetap.tap.crossrank import RankMismatch, compare_ranks
from enginetap.tap.diff import RunDiff
from enginetap.tap.files import TapRun
from enginetap.tap.pairs import PairSummary, SamplerSplit, layer_of, pair_splits, sampler_splits

__all__ = ["Analysis", "analyse", "diff_page", "html_page", "summary"]


@dataclass
class RankAnalysis:
    rank: int
    steps: int
    rows: int
    pairs: PairSummary
    continuity: list[Violation]
    metadata: list[Violation]
    sampler: list[SamplerSplit]
    layers: list[str] = field(default_factory=list)
    step_numbers: list[int] = field(default_factory=list)
    metadata_rows: dict[str, int] = field(default_factory=dict)
    """Tapped rows that carried each metadata check's inputs (``counters``, ``lengths``)."""

    def grid(self) -> Counter:
        """(layer, step) → row pairs whose first differing checkpoint at that step is there."""
        return self.pairs.cells


@dataclass
class Analysis:
    header: dict[str, Any]
    ranks: list[RankAnalysis]
    cross_rank: list[RankMismatch] = field(default_factory=list)


def _layers(run_rank: Any) -> list[str]:
    seen: dict[str, None] = {}
    for step in run_rank.steps:
        for name in step.checkpoints:
            seen.setdefault(layer_of(name), None)
    return list(seen)


def analyse(run: TapRun) -> Analysis:
    ranks = []
    for number, rank in run.ranks.items():
        ranks.append(RankAnalysis(number, len(rank.steps), sum(len(s.rows) for s in rank.steps),
                                  pair_splits(rank), check_continuity(rank),
                                  check_metadata(rank), sampler_splits(rank),
                                  _layers(rank), [s.step for s in rank.steps],
                                  metadata_checked(rank)))
    return Analysis(run.header, ranks, compare_ranks(run))


def summary(analysis: Analysis) -> list[str]:
    """Plain lines for a terminal."""
    h = analysis.header
    lines = [f"tap run: engine {h.get('engine')} ({h.get('engine_version')}), "
             f"{h.get('world_size')} rank(s), models "
             f"{', '.join(str(m.get('model_type')) for m in h.get('models', []))}"]
    if len(analysis.ranks) > 1:
        lines.append(f"cross-rank: {len(analysis.cross_rank)} replicated checkpoint(s) differ "
                     "between ranks")
        for m in analysis.cross_rank[:20]:
            lines.append(f"  step {m.step} {m.checkpoint} request {m.key} position "
                         f"{m.position}: rank(s) {m.ranks} differ from rank 0")
    for r in analysis.ranks:
        lines.append(f"rank {r.rank}: {r.steps} steps, {r.rows} tapped rows, "
                     f"{r.pairs.pairs_compared} same-prefix row pair(s), {r.pairs.pairs_split} "
                     f"split, {len(r.continuity)} continuity "
                     f"and {len(r.metadata)} metadata violation(s), {len(r.sampler)} "
                     "sampler flip(s)")
        lines.append(f"  metadata checked on {r.metadata_rows.get('counters', 0)} row(s) "
                     f"(host vs device counters) and {r.metadata_rows.get('lengths', 0)} "
                     "row(s) (planned vs valid lengths)")
        for p in r.pairs.splits[:20]:
            lines.append(f"  split at step {p.step} position {p.position}: {p.describe()}, "
                         f"culprit {p.checkpoint} (input {p.agreeing_input} agrees), "
                         f"{p.pairs} row pair(s)")
        for v in (r.continuity + r.metadata)[:20]:
            lines.append(f"  {v.kind} violation at step {v.step}: {v.checkpoint} request "
                         f"{v.key} position {v.position} slot {v.slot}: {v.detail}")
        for s in r.sampler[:20]:
            said = " vs ".join(f"{', '.join(k)}{f' (+{n - len(k)})' if n > len(k) else ''}"
                               f"->{t}" for t, n, k in s.tokens[:6])
            if len(s.tokens) > 6:
                said += f" vs {len(s.tokens) - 6} more token(s)"
            lines.append(f"  {s.kind} at step {s.step}: {said} (smallest gap {s.min_gap:.3g})")
    return lines


_STYLE = """body{font-family:sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse;
margin:.5em 0 1.5em}td,th{border:1px solid #bbb;padding:2px 6px;font-size:13px}
th{background:#eee}td.c0{background:#f4fff4}td.hot{background:#e55;color:#fff}
.none{color:#777}"""

_SCRIPT = """document.querySelectorAll('td.hot').forEach(function(c){
c.addEventListener('click',function(){alert(c.title);});});
document.getElementById('status').textContent='rendered';"""


def _table(title: str, head: list[str], rows: list[list[Any]]) -> str:
    if not rows:
        return f"<h3>{html.escape(title)}</h3><p class='none'>none</p>"
    cells = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
                    for row in rows)
    header = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    return f"<h3>{html.escape(title)}</h3><table><tr>{header}</tr>{cells}</table>"


def _grid(title: str, layers: list[str], steps: list[int], cells: Counter,
          what: str) -> str:
    """A layer x step table; a cell counts the ``what`` first diverging there."""
    head = "".join(f"<th>{s}</th>" for s in steps)
    body = []
    for layer in layers:
        row = []
        for step in steps:
            n = cells.get((layer, step), 0)
            tip = html.escape(f"{layer} step {step}: {n} {what}", quote=True)
            row.append(f"<td class='{'hot' if n else 'c0'}' title='{tip}'>{n or ''}</td>")
        body.append(f"<tr><th>{html.escape(layer)}</th>{''.join(row)}</tr>")
    return (f"<h3>{html.escape(title)}</h3><table><tr><th>layer \\ step</th>{head}</tr>"
            f"{''.join(body)}</table>")


def _rank_html(r: RankAnalysis) -> str:
    pairs = [[p.describe(), p.pairs, p.step, p.position, p.checkpoint, p.agreeing_input]
             for p in r.pairs.splits[:_LISTED]]
    violations = [[v.kind, v.step, v.checkpoint, v.key, v.position, v.slot, v.detail]
                  for v in r.continuity]
    metadata = [[v.kind, v.step, v.key, v.position, v.detail] for v in r.metadata]
    checked = (f"<p>Metadata checked on {r.metadata_rows.get('counters', 0)} row(s) (host vs "
               f"device counters) and {r.metadata_rows.get('lengths', 0)} row(s) (planned vs "
               "valid lengths).</p>")
    sampler = [[s.step, " vs ".join(f"{', '.join(k)} ({n})->{t}" for t, n, k in s.tokens[:20])
                + (f" vs {len(s.tokens) - 20} more" if len(s.tokens) > 20 else ""),
                f"{s.min_gap:.4g}", s.kind] for s in r.sampler[:_LISTED]]
    grid = _grid("Where pairs split (layer x step)", r.layers, r.step_numbers, r.grid(),
                 "pair(s) split here")
    return (f"<h2>Rank {r.rank}: {r.steps} steps, {r.rows} tapped rows</h2>{grid}"
            + _table(f"Same-prefix splits ({r.pairs.pairs_compared} row pairs compared, "
                     f"{r.pairs.pairs_split} split; {_more(len(r.pairs.splits))})",
                     ["classes of requests", "row pairs", "step", "position", "culprit",
                      "agreeing input"], pairs)
            + _table("Continuity violations", ["kind", "step", "checkpoint", "request",
                                               "position", "slot", "detail"], violations)
            + checked + _table("Metadata (counters, planned vs valid lengths)",
                               ["kind", "step", "request", "position", "detail"], metadata)
            + _table(f"Sampler flips ({_more(len(r.sampler))})",
                     ["step", "requests (count) -> token", "smallest gap", "kind"], sampler))


_LISTED = 500
"""Rows a table of the page lists (its title says how many there are)."""


def _more(count: int) -> str:
    return f"{count} found" + (f", the first {_LISTED} listed" if count > _LISTED else "")


def html_page(analysis: Analysis) -> str:
    """One self-contained HTML page (inline style and script, nothing fetched)."""
    lines = "".join(f"<li>{html.escape(line)}</li>" for line in summary(analysis))
    body = "".join(_rank_html(r) for r in analysis.ranks) + _table(
        "Cross-rank (replicated checkpoints that differ from rank 0)",
        ["step", "checkpoint", "request", "position", "ranks"],
        [[m.step, m.checkpoint, m.key, m.position, m.ranks] for m in analysis.cross_rank])
    return _page("enginetap tap report", f"<ul>{lines}</ul>{body}")


def _page(title: str, body: str) -> str:
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
            f"</title><style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
            f"<p id='status'>static</p>{body}<script>{_SCRIPT}</script></body></html>")


def diff_page(diffs: list[RunDiff], run_a: TapRun, lines: list[str]) -> str:
    """The diff of two runs as one page: per rank a layer x step (run A's steps) picture
    of where aligned rows first diverge, and the first divergence of every request."""
    parts = [f"<ul>{''.join(f'<li>{html.escape(x)}</li>' for x in lines)}</ul>"]
    for d in diffs:
        rank = run_a.ranks[d.rank]
        parts.append(f"<h2>Rank {d.rank}</h2>" + _grid(
            "Where rows first diverge (layer x step of run A)", _layers(rank),
            [s.step for s in rank.steps], d.cells, "row(s) first diverge here"))
        parts.append(_table("First divergence per request", ["request", "position",
                                                             "step A", "step B", "checkpoint"],
                            [[f.key, f.position, f.step_a, f.step_b, f.checkpoint]
                             for _, f in sorted(d.per_request.items())]))
    return _page("enginetap tap diff", "".join(parts))
