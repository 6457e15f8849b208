"""The definition x solution summary of a replay: one row per pair, as data and as a table."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from rich import box
from rich.markup import escape
from rich.table import Table

from enginetap.replay.report import (
    DefinitionResult,
    OutputCheck,
    SolutionSummary,
    Status,
    agreement,
    engine_exact,
    tolerance,
    worst,
)

if TYPE_CHECKING:
    from enginetap.replay.report import ReplayReport

__all__ = ["render_summary", "summarize", "summary_notes"]

_LOOSEST = ("failing", "within tolerance", "exact")


def summarize(report: ReplayReport) -> list[SolutionSummary]:
    """Per replayed definition and solution: statuses, median times, worst errors."""
    return [_row(d, name) for d in report.definitions if d.workloads
            for name in report.options.solutions]


def _row(result: DefinitionResult, solution: str) -> SolutionSummary:
    per_workload: list[Status] = []
    checks: list[OutputCheck] = []
    exact_engine = 0
    for w in result.workloads:
        mine = [c for c in w.checks if c.check == "candidate" and c.solution == solution]
        checks += mine
        per_workload.append(worst([c.status for c in mine]) if mine else w.status)
        exact_engine += any(engine_exact(w, c) for c in mine)
    counts = {s: per_workload.count(s) for s in dict.fromkeys(per_workload)}
    ref = _median([w.reference_ms for w in result.workloads])
    cand = _median([w.candidate_ms.get(solution) for w in result.workloads])
    errors = [c.comparison.max_abs_error for c in checks
              if c.comparison is not None and c.comparison.max_abs_error is not None]
    relative = [c.comparison.max_rel_error for c in checks
                if c.comparison is not None and c.comparison.max_rel_error is not None]
    agreements = {agreement(c) for c in checks} - {None}
    tolerances = dict.fromkeys(tolerance(c.comparison) for c in checks if c.comparison)
    tolerances.pop("-", None)
    return SolutionSummary(
        definition=result.name, solution=solution, status=worst(per_workload), counts=counts,
        reference_ms=ref, candidate_ms=cand, speedup=ref / cand if ref and cand else None,
        max_abs_error=max(errors, default=None),
        nonfinite=sum(c.comparison.nonfinite for c in checks if c.comparison is not None),
        reason=_reason(checks), max_rel_error=max(relative, default=None),
        agreement=next((a for a in _LOOSEST if a in agreements), None),
        tolerance=" | ".join(tolerances) or None, engine_exact=exact_engine)


def _reason(checks: list[OutputCheck]) -> str | None:
    for check in checks:
        if check.status != "PASS":
            return check.message or (check.comparison.reason if check.comparison else None)
    return None


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


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


def _num(value: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{suffix}"
