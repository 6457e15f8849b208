"""``enginetap tap report``: what one run's pairs, continuity and sampler say.

:func:`analyse` runs every check over every rank; :func:`summary` renders it for a
terminal and :func:`html_page` as one self-contained page (no external resources): the
pairs that split, earliest and largest first, each with its size where raw rows exist and
the commands to run next; a layer x step picture of where pairs split, with its legend;
then tables of continuity, metadata and sampler findings.
"""

from __future__ import annotations

import html
import json
import shlex
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from enginetap.tap.analysis.continuity import (Violation, check_continuity, check_metadata,
                                      metadata_checked)
from enginetap.tap.analysis.crossrank import RankMismatch, compare_ranks
from enginetap.tap.analysis.diff import RunDiff
from enginetap.tap.analysis.files import TapRun
from enginetap.tap.schema import RUN_FILE
from enginetap.tap.analysis.pairs import (PairSummary, SamplerSplit, SplitFinding, layer_of,
                                  pair_splits, sampler_splits)
from enginetap.tap.analysis.splitsize import SplitSize, split_size

__all__ = ["Analysis", "analyse", "diff_page", "html_page", "next_commands", "summary"]


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
    if h.get("not_placed"):  # compiled / CUDA-graph runs (tap/record/compiled.py)
        lines.append(f"not placed under {h.get('compiled')} (not recorded in this mode): "
                     f"{', '.join(h['not_placed'])}")
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


_STYLE = """body{font-family:sans-serif;margin:1.5em;color:#222;max-width:80em}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #bbb;
padding:2px 6px;font-size:13px}th{background:#eee}td.c0{background:#f4fff4}
td.hot{background:#e55;color:#fff}.none{color:#777}.legend{font-size:13px;color:#444}
.legend span.key{display:inline-block;width:1.2em;border:1px solid #bbb;margin:0 .3em}
pre.next{background:#f6f6f6;border:1px solid #ddd;padding:.4em;white-space:pre-wrap;
font-size:12px}div.finding{border-left:3px solid #e55;padding-left:.8em;margin:1em 0}"""

_SCRIPT = """document.querySelectorAll('td.hot').forEach(function(c){
c.addEventListener('click',function(){alert(c.title);});});
document.body.setAttribute('data-rendered','yes');"""


def _cell(value: Any) -> str:
    return "" if value is None else html.escape(str(value))


def _table(title: str, head: list[str], rows: list[list[Any]]) -> str:
    if not rows:
        return f"<h3>{html.escape(title)}</h3><p class='none'>none</p>"
    cells = "".join("<tr>" + "".join(f"<td>{_cell(c)}</td>" for c in row) + "</tr>"
                    for row in rows)
    header = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    return f"<h3>{html.escape(title)}</h3><table><tr>{header}</tr>{cells}</table>"


def _legend(what: str) -> str:
    return ("<p class='legend grid-legend'>How to read it: one row per decoder layer "
            "(<b>L0</b> is the first; <b>model</b> holds the checkpoints outside the layers, "
            "such as the final norm), one column per recorded engine step (the engine's step "
            "number: a prefill or a decode step). "
            f"<span class='key' style='background:#e55'>&nbsp;</span>a number: the {what} "
            "at that step, counted in the layer of the first differing checkpoint (hover or "
            "click for the count); <span class='key' style='background:#f4fff4'>&nbsp;</span>"
            "none. The leftmost red column holds the earliest divergence: look there first.</p>")


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
    return (f"<h3>{html.escape(title)}</h3>{_legend(what)}<table><tr><th>layer \\ step</th>"
            f"{head}</tr>{''.join(body)}</table>")


def _split_keys(s: SplitFinding) -> tuple[str, str]:
    """Two requests on either side of a split: the first keys of its first two classes."""
    return s.classes[0][1][0], s.classes[1][1][0]


def _ordered(r: RankAnalysis, root: Path | None) -> list[tuple[SplitFinding, SplitSize | None]]:
    """Splits, earliest first; at one step the largest (measured where raw rows exist,
    else the split of the most row pairs); at most ``_LISTED`` of them."""
    found = [(s, split_size(root, r.rank, s.step, s.checkpoint, _split_keys(s), s.position)
              if root is not None else None) for s in r.pairs.splits]
    found.sort(key=lambda f: (f[0].step, -(f[1].max_abs if f[1] else 0.0), -f[0].pairs,
                              f[0].position, f[0].checkpoint))
    return found[:_LISTED]


def _base_command(command: dict[str, Any] | None, **change: Any) -> str:
    if command is None:
        return "enginetap tap run --model MODEL --prompts PROMPTS"
    c = {**command, **change}
    flags = [("engine", None), ("model", None), ("prompts", None), ("batch_size", None),
             ("max_new_tokens", None), ("max_rows", 64), ("tp", 1), ("depth", "sublayers"),
             ("device", "cpu"), ("dtype", "auto"), ("mode", "eager")]
    parts = ["enginetap tap run"] + [f"--{k.replace('_', '-')} {shlex.quote(str(c[k]))}"
                                     for k, plain in flags
                                     if c.get(k) is not None and c.get(k) != plain]
    return " ".join(parts)


def next_commands(s: SplitFinding, run: str, command: dict[str, Any] | None) -> list[str]:
    """What to run next for a split: the run again writing the raw rows of two requests on
    either side at the split (culprit and its agreeing input), and a diff against batch
    size 1."""
    points = [x for x in (s.checkpoint, s.agreeing_input) if x and x != "token ids"]
    dump = f"{run}-split{s.step}"
    lines = [f"{_base_command(command)} --out {shlex.quote(dump)} --vector-steps "
             f"{s.step} --vector-checkpoints {','.join(points)} --vector-requests "
             f"{','.join(_split_keys(s))}",
             f"enginetap tap report {shlex.quote(dump)} --html {shlex.quote(dump)}.html"]
    if command is None or command.get("batch_size", 2) > 1:
        alone = f"{run}-b1"
        lines += [f"{_base_command(command, batch_size=1)} --out {shlex.quote(alone)}",
                  f"enginetap tap diff {shlex.quote(run)} {shlex.quote(alone)}"]
    return lines


def _finding(n: int, s: SplitFinding, size: SplitSize | None, run: str,
             command: dict[str, Any] | None) -> str:
    a, b = _split_keys(s)
    what = (f"<b>{n}. {html.escape(a)} / {html.escape(b)}</b>: first split at step {s.step}, "
            f"position {s.position}, in <b>{_cell(s.checkpoint)}</b> (its input "
            f"{_cell(s.agreeing_input)} agrees); {s.pairs} row pair(s) split here, into "
            f"{len(s.classes)} class(es): {html.escape(s.describe())}.")
    size_text = (f"Size: {html.escape(size.describe())}." if size else
                 "Size: no raw rows were written at this split (the first command below "
                 "writes them).")
    todo = "\n".join(next_commands(s, run, command))
    return (f"<div class='finding'><p>{what}</p><p>{size_text}</p><p>Next:</p>"
            f"<pre class='next'>{html.escape(todo)}</pre></div>")


def _pairs_html(r: RankAnalysis, root: Path | None, command: dict[str, Any] | None) -> str:
    run = str(root) if root is not None else "RUN"
    ordered = _ordered(r, root)
    summary_ = r.pairs
    parts = [f"<h3>Same-prefix splits ({summary_.pairs_compared} row pairs compared, "
             f"{summary_.pairs_split} split; {_more(len(summary_.splits))}; earliest split "
             "first, then largest)</h3>"]
    if not ordered:
        parts.append("<p class='none'>none: every same-prefix pair stayed bitwise equal</p>")
    parts += [_finding(n, s, size, run, command) for n, (s, size) in enumerate(ordered, 1)]
    if command is None and ordered:
        parts.append("<p class='legend'>This run was not recorded by <code>enginetap tap "
                     "run</code>: put its model and prompts in the commands.</p>")
    equal = summary_.pairs_compared - summary_.pairs_split
    if equal and ordered:
        parts.append(f"<p class='equal'>{equal} of {summary_.pairs_compared} same-prefix row "
                     "pair(s) stayed equal at every checkpoint.</p>")
    return "".join(parts)


def _rank_html(r: RankAnalysis, root: Path | None, command: dict[str, Any] | None) -> str:
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
                 "row pair(s) split here")
    return (f"<h2>Rank {r.rank}: {r.steps} steps, {r.rows} tapped rows</h2>"
            + _pairs_html(r, root, command) + grid
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


def _run_command(root: Path | None) -> dict[str, Any] | None:
    """What ``enginetap tap run`` was asked for this run (its ``tap-run.json``), if any."""
    if root is None:
        return None
    from enginetap.core.files import read_capped

    try:
        found = json.loads(read_capped(root / RUN_FILE, 1 << 20))
    except (OSError, ValueError, RecursionError):
        return None
    keys = ("engine", "model", "prompts", "batch_size", "max_new_tokens")
    return found if isinstance(found, dict) and all(k in found for k in keys) else None


def html_page(analysis: Analysis, run_dir: Path | None = None) -> str:
    """One self-contained HTML page (inline style and script, nothing fetched). With
    ``run_dir`` (the run's folder) each finding carries the commands to run next (built
    from its ``tap-run.json``) and, where raw rows were written, the size of the split."""
    command = _run_command(run_dir)
    lines = "".join(f"<li>{html.escape(line)}</li>" for line in summary(analysis))
    body = "".join(_rank_html(r, run_dir, command) for r in analysis.ranks) + _table(
        "Cross-rank (replicated checkpoints that differ from rank 0)",
        ["step", "checkpoint", "request", "position", "ranks"],
        [[m.step, m.checkpoint, m.key, m.position, m.ranks] for m in analysis.cross_rank])
    return _page("enginetap tap report", f"<ul>{lines}</ul>{body}")


def _page(title: str, body: str) -> str:
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
            f"</title><style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
            f"{body}<script>{_SCRIPT}</script></body></html>")


def diff_page(diffs: list[RunDiff], run_a: TapRun, lines: list[str]) -> str:
    """The diff of two runs as one page: per rank a layer x step (run A's steps) picture
    of where aligned rows first diverge, and the first divergence of every request."""
    parts = [f"<ul>{''.join(f'<li>{html.escape(x)}</li>' for x in lines)}</ul>"]
    for d in diffs:
        rank = run_a.ranks[d.rank]
        parts.append(f"<h2>Rank {d.rank}</h2>" + _grid(
            "Where rows first diverge (layer x step of run A)", _layers(rank),
            [s.step for s in rank.steps], d.cells, "aligned rows that first diverge"))
        parts.append(_table("First divergence per request", ["request", "position",
                                                             "step A", "step B", "checkpoint"],
                            [[f.key, f.position, f.step_a, f.step_b, f.checkpoint]
                             for _, f in sorted(d.per_request.items())]))
    return _page("enginetap tap diff", "".join(parts))
