"""What a replay found, as pydantic models (saved with ``--json``); :mod:`~enginetap.replay.render`
shows them.

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

import statistics
from typing import Literal

from pydantic import BaseModel, Field, computed_field

from enginetap.replay.compare import Comparison

__all__ = ["NOT_EXPOSED", "DefinitionResult", "OutputCheck", "ReplayOptions", "ReplayReport",
           "SolutionSummary", "Status", "WorkloadResult", "agreement", "engine_exact",
           "summarize", "tolerance", "worst"]

Status = Literal["PASS", "SKIPPED", "FAIL", "ERROR", "REFUSED"]
_RANK: dict[str, int] = {"PASS": 0, "SKIPPED": 1, "FAIL": 2, "ERROR": 3, "REFUSED": 4}


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
