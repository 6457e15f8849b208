"""What a replay found, as pydantic models (saved with ``--json``) and as a rich table.

Statuses, worst last: ``PASS``, ``FAIL`` (a comparison failed), ``ERROR`` (something could
not run: unreadable workload, a reference or candidate that raised), ``REFUSED`` (a
definition whose reference enginetap did not generate, without ``--trust-dataset-code``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, computed_field
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from enginetap.replay.compare import Comparison

__all__ = ["DefinitionResult", "OutputCheck", "ReplayOptions", "ReplayReport", "WorkloadResult",
           "problem_lines", "render_tables", "worst"]

Status = Literal["PASS", "FAIL", "ERROR", "REFUSED"]
_RANK: dict[str, int] = {"PASS": 0, "FAIL": 1, "ERROR": 2, "REFUSED": 3}
_STYLE = {"PASS": "green", "FAIL": "red", "ERROR": "red", "REFUSED": "yellow"}


def worst(statuses: list[Status]) -> Status:
    """The most severe of ``statuses`` (PASS when empty)."""
    return max(statuses, key=_RANK.__getitem__, default="PASS")


class ReplayOptions(BaseModel):
    """The options a replay ran with."""

    dataset: str
    definitions: list[str] | None = None
    solution: str | None = None
    trust_dataset_code: bool = False
    device: str = "cpu"
    warmup: int = 1
    repeats: int = 3


class OutputCheck(BaseModel):
    """One output of one workload checked against the reference's."""

    output: str
    """Output name (``-`` for a ``reference`` check, which covers all outputs)."""
    check: Literal["engine", "candidate", "reference"]
    """``engine``: stored engine output vs reference; ``candidate``: candidate vs reference;
    ``reference``: only the reference ran (nothing stored to compare), its outputs had the
    definition's shapes and dtypes."""
    status: Status
    comparison: Comparison | None = None
    vs_engine: Comparison | None = None
    """For ``candidate``: the candidate vs the stored engine output (informational)."""
    message: str | None = None


class WorkloadResult(BaseModel):
    """Everything checked for one workload."""

    uuid: str
    status: Status
    message: str | None = None
    """Why the workload could not run (ERROR), in one line."""
    reference_ms: float | None = None
    candidate_ms: float | None = None
    checks: list[OutputCheck] = Field(default_factory=list)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def speedup(self) -> float | None:
        """Reference time over candidate time."""
        if self.reference_ms is None or not self.candidate_ms:
            return None
        return self.reference_ms / self.candidate_ms


class DefinitionResult(BaseModel):
    """One definition: which reference ran, and its workloads."""

    name: str
    status: Status
    message: str | None = None
    reference: Literal["enginetap", "dataset"] | None = None
    """``enginetap``: our regenerated source; ``dataset``: the file's, trusted by the user."""
    workloads: list[WorkloadResult] = Field(default_factory=list)


class ReplayReport(BaseModel):
    """The whole replay: options, dataset problems, results, environment."""

    options: ReplayOptions
    problems: list[str] = Field(default_factory=list)
    """Problems ``validate_dataset`` found, one line each."""
    definitions: list[DefinitionResult] = Field(default_factory=list)
    created_at: str
    enginetap_version: str
    torch_version: str

    @computed_field  # type: ignore[prop-decorator]
    @property
    def counts(self) -> dict[str, int]:
        """Checks (and definition/workload-level outcomes) by status."""
        counts = dict.fromkeys(_RANK, 0)
        for status in self._statuses():
            counts[status] += 1
        return counts

    @computed_field  # type: ignore[prop-decorator]
    @property
    def ok(self) -> bool:
        """No dataset problem and nothing but PASS."""
        return not self.problems and all(s == "PASS" for s in self._statuses())

    def _statuses(self) -> list[Status]:
        out: list[Status] = []
        for d in self.definitions:
            if not d.workloads:
                out.append(d.status)
            for w in d.workloads:
                out.extend([c.status for c in w.checks] or [w.status])
        return out


def summary_line(report: ReplayReport) -> str:
    """``ok: 36 PASS`` / ``not ok: 2 PASS, 1 FAIL`` / ``ok: nothing to replay``."""
    counts = ", ".join(f"{n} {s}" for s, n in report.counts.items() if n)
    return f"{'ok' if report.ok else 'not ok'}: {counts or 'nothing to replay'}"


def print_report(console: Console, report: ReplayReport) -> None:
    """The per-definition tables, then one line per problem (plain text, no markup)."""
    for table in render_tables(report):
        console.print(table)
    for line in problem_lines(report):
        console.print(line, markup=False, highlight=False)


def render_tables(report: ReplayReport) -> list[Table]:
    """One table per replayed definition, one row per check (or per failed workload).

    Candidate columns appear only when a candidate ran. Definitions refused or failing as a
    whole have no table: :func:`problem_lines` says why.
    """
    with_candidate = report.options.solution is not None
    return [_definition_table(d, with_candidate) for d in report.definitions if d.workloads]


def _definition_table(result: DefinitionResult, with_candidate: bool) -> Table:
    # Names, uuids and outputs are dataset data: escaped, so that no markup is read in them.
    title = f"{escape(result.name)}  {_status(result.status)}  (reference: {result.reference})"
    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left")
    for col in ("workload", "output", *(["check"] if with_candidate else []), "status"):
        table.add_column(col, no_wrap=True)
    numeric = ["max abs", "max rel", "matched", "ref ms"]
    for col in numeric + (["cand ms", "speedup"] if with_candidate else []):
        table.add_column(col, justify="right", no_wrap=True)
    for w in result.workloads:
        timing = [_num(w.reference_ms, ".3f")]
        if with_candidate:
            timing += [_num(w.candidate_ms, ".3f"), _num(w.speedup, ".2f", "x")]
        for c in w.checks or [None]:
            cells = [escape(w.uuid[:8]), escape(c.output) if c else "-"]
            cells += [c.check if c else "-"] if with_candidate else []
            cells += [_status(c.status if c else w.status), *_numbers(c and c.comparison)]
            table.add_row(*cells, *timing)
            timing = [""] * len(timing)  # once per workload
    return table


def problem_lines(report: ReplayReport) -> list[str]:
    """One line per dataset problem and per thing that did not pass."""
    lines = [f"PROBLEM {p}" for p in report.problems]
    for d in report.definitions:
        if d.message:
            lines.append(f"{d.status} {d.name}: {d.message}")
        for w in d.workloads:
            if w.message:
                lines.append(f"{w.status} {d.name} workload {w.uuid}: {w.message}")
            for c in w.checks:
                reason = c.message or (c.comparison.reason if c.comparison else None)
                if c.status != "PASS" and reason:
                    lines.append(f"{c.status} {d.name} workload {w.uuid} output {c.output} "
                                 f"({c.check}): {reason}")
    return lines


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
