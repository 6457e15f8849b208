"""A replay's results for people: per-definition tables, the definition x solution summary
table and plain one-line problems and notes (the models are in
:mod:`~enginetap.replay.results`). Dataset names in tables are escaped, never read as markup.
"""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from enginetap.replay.compare import Comparison
from enginetap.replay.results import (
    NOT_EXPOSED, DefinitionResult, OutputCheck, ReplayReport, SolutionSummary, Status,
    WorkloadResult, agreement, engine_exact, tolerance,
)

__all__ = ["print_report", "problem_lines", "render_summary", "render_tables",
           "summary_line", "summary_notes", "unexposed_lines"]

_STYLE = {"PASS": "green", "SKIPPED": "yellow", "FAIL": "red", "ERROR": "red",
          "REFUSED": "yellow"}


def summary_line(report: ReplayReport) -> str:
    """``ok: 36 PASS`` / ``not ok: 2 PASS, 1 FAIL`` / ``not ok: nothing to replay``."""
    counts = ", ".join(f"{n} {s}" for s, n in report.counts.items() if n)
    return f"{'ok' if report.ok else 'not ok'}: {counts or 'nothing to replay'}"


def print_report(console: Console, report: ReplayReport) -> None:
    """The per-definition tables, then one line per problem (plain text, no markup)."""
    for table in render_tables(report):
        console.print(table)
    for line in problem_lines(report) + unexposed_lines(report):
        # One line each, never wrapped: they are meant to be grepped.
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def unexposed_lines(report: ReplayReport) -> list[str]:
    """One line per declared output that the capturing engine does not expose (so no
    workload of the definition stores it): ``NOTE name: output lse not exposed by this
    engine in 4 of 4 workload(s); not stored, so not compared``."""
    lines = []
    for d in report.definitions:
        missing: dict[str, int] = {}
        for w in d.workloads:
            for c in w.checks:
                if c.message == NOT_EXPOSED:
                    missing[c.output] = missing.get(c.output, 0) + 1
        lines += [f"NOTE {d.name}: output {name} not exposed by this engine in {n} of "
                  f"{len(d.workloads)} workload(s); not stored, so not compared"
                  for name, n in missing.items()]
    return lines


def render_tables(report: ReplayReport) -> list[Table]:
    """One table per replayed definition, one row per check (or per failed workload).

    Candidate columns appear only when a candidate ran; SKIPPED checks are left out (the
    definition x solution summary says why). Definitions refused or failing as a
    whole have no table: :func:`problem_lines` says why.
    """
    with_candidate = bool(report.options.solutions)
    return [_definition_table(d, with_candidate) for d in report.definitions if d.workloads]


def _definition_table(result: DefinitionResult, with_candidate: bool) -> Table:
    # Names, uuids and outputs are dataset data: escaped, so that no markup is read in them.
    title = f"{escape(result.name)}  {_status(result.status)}  (reference: {result.reference})"
    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left")
    for col in ("workload", "output", *(["check"] if with_candidate else []), "status",
                "agreement"):
        table.add_column(col, no_wrap=True)
    for col in ("max abs", "max rel"):
        table.add_column(col, justify="right", no_wrap=True)
    table.add_column("tolerance", no_wrap=True)
    for col in ["matched", "ref ms"] + (["cand ms", "speedup"] if with_candidate else []):
        table.add_column(col, justify="right", no_wrap=True)
    for w in result.workloads:
        reference, timed = _num(w.reference_ms, ".3f"), set()
        # SKIPPED checks say the same for every workload: the summary table gives the reason.
        shown = [c for c in w.checks if c.status != "SKIPPED"]
        for c in shown or [None]:
            cells = [escape(w.uuid[:8]), escape(c.output) if c else "-"]
            cells += [_check_name(c)] if with_candidate else []
            numbers = _numbers(c and c.comparison)
            cells += [_status(c.status if c else w.status), _agreement_cell(c, w),
                      *numbers[:2], tolerance(c and c.comparison), numbers[2], reference]
            reference = ""  # once per workload
            if with_candidate:
                cells += _candidate_timing(w, c, timed)
            table.add_row(*cells)
    return table


def _check_name(check: OutputCheck | None) -> str:
    if check is None:
        return "-"
    return escape(check.solution) if check.check == "candidate" and check.solution else check.check


def _candidate_timing(w: WorkloadResult, check: OutputCheck | None, timed: set[str]) -> list[str]:
    """The solution's time and speedup on its first row of the workload, else blanks."""
    name = check.solution if check is not None and check.check == "candidate" else None
    if name is None or name in timed or name not in w.candidate_ms:
        return ["", ""]
    timed.add(name)
    return [_num(w.candidate_ms[name], ".3f"), _num(w.speedup.get(name), ".2f", "x")]


def _agreement_cell(check: OutputCheck | None, workload: WorkloadResult) -> str:
    said = agreement(check)
    if said is None or check is None:
        return "-"
    return said + (" (engine: exact)" if engine_exact(workload, check) else "")


def problem_lines(report: ReplayReport) -> list[str]:
    """One line per dataset problem and per thing that did not pass; a compared output's
    line ends with its max abs / max rel error and tolerance."""
    lines = [f"PROBLEM {p}" for p in report.problems]
    for d in report.definitions:
        if d.message:
            lines.append(f"{d.status} {d.name}: {d.message}")
        for w in d.workloads:
            if w.message:
                lines.append(f"{w.status} {d.name} workload {w.uuid}: {w.message}")
            for c in w.checks:
                reason = c.message or (c.comparison.reason if c.comparison else None)
                if c.status not in ("PASS", "SKIPPED") and reason:
                    lines.append(f"{c.status} {d.name} workload {w.uuid} ({_axes(w)}) output "
                                 f"{c.output} ({c.solution or c.check}): {reason}"
                                 + _error_note(w, c))
    return lines


def _error_note(workload: WorkloadResult, check: OutputCheck) -> str:
    """``; max abs 0.5, max rel 0.02 (tolerance atol=0.01 rtol=0.01)`` and whether the
    engine matched exactly, for a check that compared numbers."""
    c = check.comparison
    if c is None or (tolerance(c) == "-" and c.max_abs_error is None):
        return ""  # nothing was compared element by element (a shape or dtype mismatch)
    if c.kind == "selection":
        note = f"; tolerance {tolerance(c)}"
    else:
        errors = f"{c.nonfinite} NaN/inf mismatch(es), finite " if c.nonfinite else ""
        note = (f"; {errors}max abs {_num(c.max_abs_error, '.3g')}, max rel "
                f"{_num(c.max_rel_error, '.3g')} (tolerance {tolerance(c)})")
    if engine_exact(workload, check):
        note += "; the engine's own output matched the reference exactly"
    return note


def _axes(w: WorkloadResult) -> str:
    return " ".join(f"{k}={v}" for k, v in w.axes.items()) or "no var axes"


def _status(status: Status) -> str:
    return f"[{_STYLE[status]}]{status}[/]"


def _numbers(comparison: Comparison | None) -> list[str]:
    if comparison is None:
        return ["-", "-", "-"]
    errors = [_num(comparison.max_abs_error, ".3g"), _num(comparison.max_rel_error, ".3g")]
    if comparison.nonfinite:
        # The maxima cover finite elements only: a NaN/inf mismatch must not read as 0.
        errors = [f"{comparison.nonfinite} NaN/inf"] * 2
    return [*errors, f"{100 * comparison.matched_ratio:.2f}%"]


def _num(value: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{suffix}"


def render_summary(report: ReplayReport) -> Table | None:
    """The summary as a rich table (None when no solution was given).

    Pairs where a built-in solution has no adapter for the definition's family at all are
    left out of the table (the JSON keeps them); the caption counts them.
    """
    from enginetap.replay.builtin import UNCOVERED

    every = report.summary
    if not every:
        return None
    rows = [r for r in every if not (r.status == "SKIPPED" and r.reason
                                     and r.reason.startswith(UNCOVERED))]
    left_out = len(every) - len(rows)
    caption = (f"{left_out} pair(s) whose solution has no adapter for the family are not shown"
               if left_out else None)
    table = Table(title="definition x solution", box=box.SIMPLE_HEAD, title_justify="left",
                  caption=caption, caption_justify="left")
    for col in ("definition", "solution", "status", "agreement", "workloads"):
        table.add_column(col, no_wrap=True)
    for col in ("max abs", "max rel"):
        table.add_column(col, justify="right", no_wrap=True)
    table.add_column("tolerance", no_wrap=True)
    for col in ("NaN/inf", "ref ms", "cand ms", "speedup"):
        table.add_column(col, justify="right", no_wrap=True)
    table.add_column("why")
    for row in rows:
        counts = ", ".join(f"{n} {s}" for s, n in row.counts.items())
        said = (row.agreement or "-") + (" (engine: exact)" if _engine_note(row) else "")
        table.add_row(escape(row.definition), escape(row.solution), _styled(row.status),
                      said, counts, _num(row.max_abs_error, ".3g"),
                      _num(row.max_rel_error, ".3g"), escape(row.tolerance or "-"),
                      str(row.nonfinite), _num(row.reference_ms, ".3f"),
                      _num(row.candidate_ms, ".3f"), _num(row.speedup, ".2f", "x"),
                      escape(row.reason or ""))
    return table


def summary_notes(report: ReplayReport) -> list[str]:
    """One ``NOTE`` line per definition x solution that is not exact where the engine's own
    output was: the hint that a pass within tolerance may still be a bug."""
    return [f"NOTE {row.solution} on {row.definition}: {row.agreement} (max abs "
            f"{_num(row.max_abs_error, '.3g')}, max rel {_num(row.max_rel_error, '.3g')}; "
            f"tolerance {row.tolerance or '-'}), but the engine's own output matched the "
            f"reference exactly on {row.engine_exact} of {_compared(row)} workload(s) where "
            "this solution's did not: the difference is the solution's, not rounding the "
            "engine shares" for row in report.summary if _engine_note(row)]


def _engine_note(row: SolutionSummary) -> bool:
    return row.engine_exact > 0 and row.agreement in ("within tolerance", "failing")


def _compared(row: SolutionSummary) -> int:
    return sum(n for status, n in row.counts.items() if status in ("PASS", "FAIL"))


def _styled(status: Status) -> str:
    color = {"PASS": "green", "SKIPPED": "yellow"}.get(status, "red")
    return f"[{color}]{status}[/]"
