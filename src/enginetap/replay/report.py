"""What a replay found, as pydantic models (saved with ``--json``) and as a rich table.

Statuses, worst last: ``PASS``, ``SKIPPED`` (a built-in solution that does not cover the
definition's family, whose library is not installed or that does not run on this device:
nothing was checked, and it never counts as a pass), ``FAIL`` (a comparison failed),
``ERROR`` (something could not run: unreadable workload, a reference or candidate that
raised or ended its process), ``REFUSED`` (a definition whose reference enginetap did not
generate, without ``--trust-dataset-code``). A replay is ``ok`` when something was replayed
and nothing is worse than SKIPPED (nothing replayed is never ok); the summary line counts
the SKIPPED checks.

Every compared row also says how close it came (:func:`agreement`): ``exact`` (every
element equal to the reference's), ``within tolerance`` (a pass that is not exact) or
``failing``, beside its max abs / max rel error and the tolerance it was held to
(:func:`tolerance`). A candidate that is not exact where the engine's own stored output
matched the reference exactly is marked ``(engine: exact)``: its difference is real, not
rounding the engine also does, even when it is within tolerance.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, computed_field
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from enginetap.replay.compare import Comparison

__all__ = ["NOT_EXPOSED", "DefinitionResult", "OutputCheck", "ReplayOptions", "ReplayReport",
           "SolutionSummary", "WorkloadResult", "agreement", "engine_exact", "problem_lines",
           "render_tables", "tolerance", "unexposed_lines", "worst"]

Status = Literal["PASS", "SKIPPED", "FAIL", "ERROR", "REFUSED"]
_RANK: dict[str, int] = {"PASS": 0, "SKIPPED": 1, "FAIL": 2, "ERROR": 3, "REFUSED": 4}
_STYLE = {"PASS": "green", "SKIPPED": "yellow", "FAIL": "red", "ERROR": "red",
          "REFUSED": "yellow"}


def worst(statuses: list[Status]) -> Status:
    """The most severe of ``statuses`` (PASS when empty)."""
    return max(statuses, key=_RANK.__getitem__, default="PASS")


class ReplayOptions(BaseModel):
    """The options a replay ran with."""

    dataset: str
    definitions: list[str] | None = None
    solutions: list[str] = Field(default_factory=list)
    """Candidates, in the order given: built-in names or ``module:function``."""
    trust_dataset_code: bool = False
    device: str = "cpu"
    warmup: int = 1
    repeats: int = 3
    timeout: float | None = 600.0
    """Seconds one call of a candidate or reference may take in its child process (warm-up
    and timed runs included; loading it too) before it is killed; None: no limit."""
    memory_limit: int | None = None
    """Bytes one call of a candidate or reference may allocate, and a workload may expand
    to (its tensors, plus the pages it gathers); None: no limit."""


class OutputCheck(BaseModel):
    """One output of one workload checked against the reference's."""

    output: str
    """Output name (``-`` for a ``reference`` check, which covers all outputs)."""
    check: Literal["engine", "candidate", "reference"]
    """``engine``: stored engine output vs reference; ``candidate``: candidate vs reference;
    ``reference``: only the reference ran (nothing stored to compare), its outputs had the
    definition's shapes and dtypes."""
    status: Status
    solution: str | None = None
    """For ``candidate``: which solution."""
    comparison: Comparison | None = None
    vs_engine: Comparison | None = None
    """For ``candidate``: the candidate vs the stored engine output (informational)."""
    message: str | None = None


class WorkloadResult(BaseModel):
    """Everything checked for one workload."""

    uuid: str
    status: Status
    axes: dict[str, int] = Field(default_factory=dict)
    """The workload's var axes: with the definition's const axes, every tensor's shape."""
    message: str | None = None
    """Why the workload could not run (ERROR), in one line."""
    reference_ms: float | None = None
    candidate_ms: dict[str, float | None] = Field(default_factory=dict)
    """Median time of each solution that ran, by solution."""
    checks: list[OutputCheck] = Field(default_factory=list)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def speedup(self) -> dict[str, float | None]:
        """Reference time over each solution's time."""
        return {name: self.reference_ms / ms if self.reference_ms is not None and ms else None
                for name, ms in self.candidate_ms.items()}


class DefinitionResult(BaseModel):
    """One definition: which reference ran, and its workloads."""

    name: str
    status: Status
    message: str | None = None
    reference: Literal["enginetap", "dataset"] | None = None
    """``enginetap``: our regenerated source; ``dataset``: the file's, trusted by the user."""
    workloads: list[WorkloadResult] = Field(default_factory=list)


class SolutionSummary(BaseModel):
    """One definition x one solution: what its candidate checks found over the workloads."""

    definition: str
    solution: str
    status: Status
    """The worst of its checks (SKIPPED: it never ran)."""
    counts: dict[str, int]
    """Workloads by the worst status of this solution's checks on them."""
    reference_ms: float | None = None
    """Median over workloads of the reference's median time."""
    candidate_ms: float | None = None
    """Median over workloads of the solution's median time."""
    speedup: float | None = None
    """``reference_ms / candidate_ms``."""
    max_abs_error: float | None = None
    """Largest finite error of any output on any workload."""
    nonfinite: int = 0
    """NaN/inf mismatches (unexpected NaNs included) over all outputs and workloads."""
    reason: str | None = None
    """Why it was skipped, or the first failure's reason (one line)."""
    max_rel_error: float | None = None
    """Largest finite relative error of any output on any workload."""
    agreement: Literal["exact", "within tolerance", "failing"] | None = None
    """The loosest over its compared outputs (None: nothing compared)."""
    tolerance: str | None = None
    """The tolerance(s) its outputs were held to (see :func:`tolerance`)."""
    engine_exact: int = 0
    """Workloads where the engine's stored output matched the reference exactly and this
    solution's did not: a real difference even when within tolerance."""


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
        """Something was replayed, no dataset problem and nothing worse than SKIPPED."""
        statuses = self._statuses()
        return (bool(statuses) and not self.problems
                and all(_RANK[s] <= _RANK["SKIPPED"] for s in statuses))

    @computed_field  # type: ignore[prop-decorator]
    @property
    def summary(self) -> list[SolutionSummary]:
        """One row per definition and solution (see :func:`summarize`)."""
        from enginetap.replay.summary import summarize

        return summarize(self)

    def _statuses(self) -> list[Status]:
        out: list[Status] = []
        for d in self.definitions:
            if not d.workloads:
                out.append(d.status)
            for w in d.workloads:
                out.extend([c.status for c in w.checks] or [w.status])
        return out


NOT_EXPOSED = "not exposed by this engine; not stored, so not compared"
"""The message of a ``reference`` check on an output the capturing engine does not expose."""


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


def agreement(check: OutputCheck | None) -> Literal["exact", "within tolerance", "failing"] | None:
    """How close a compared output came: ``exact`` (every element equal; a selection's
    index sets equal without ties), ``within tolerance`` (passed, not exact), ``failing``;
    None when nothing was compared (SKIPPED, ERROR, a reference-only check)."""
    if check is None or check.status in ("SKIPPED", "ERROR", "REFUSED"):
        return None
    c = check.comparison
    if c is None:
        return "failing" if check.status == "FAIL" else None
    if check.status != "PASS" or not c.passed:
        return "failing"
    return "within tolerance" if c.max_abs_error or c.ties else "exact"


def engine_exact(workload: WorkloadResult, check: OutputCheck) -> bool:
    """``check`` is a candidate's, not exact, on an output whose stored engine value
    matched the reference exactly on this workload."""
    if check.check != "candidate" or agreement(check) in (None, "exact"):
        return False
    return any(e.check == "engine" and e.output == check.output and agreement(e) == "exact"
               for e in workload.checks)


def tolerance(comparison: Comparison | None) -> str:
    """The tolerance a comparison held its output to, in a few words: ``atol=0.01
    rtol=0.01`` (float), ``exact``, ``same index sets`` (selection, ``; ties <= atol`` when
    scores may break a tie); ``-`` when it never got that far (no comparison, a shape or
    dtype mismatch)."""
    if comparison is None:
        return "-"
    if comparison.kind == "exact":
        return "exact"
    if comparison.kind == "selection":
        ties = f"; ties <= {comparison.atol:.3g}" if comparison.atol is not None else ""
        return "same index sets" + ties
    if comparison.atol is None or comparison.rtol is None:
        return "-"
    return f"atol={comparison.atol:.3g} rtol={comparison.rtol:.3g}"


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
