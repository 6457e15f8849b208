"""Replay a dataset: run each definition's reference (and a candidate) on stored inputs.

A dataset is data, not code. A definition whose reference is byte-identical to what
enginetap generates for its family runs enginetap's own regenerated source; any other
(foreign or edited) definition is REFUSED unless the caller passes
``trust_dataset_code=True``, and its stored source is never executed otherwise.

For each workload: load the inputs, run the reference on clones of them, check its outputs
have the definition's shapes and dtypes, then compare it with the stored engine outputs
(``engine`` checks) and with the candidate's outputs (``candidate`` checks), using the
family's :class:`CompareRule` per output (no family: integers and bools exact, floats by
tolerance). Problems with the dataset itself (``validate_dataset``) are listed in the report
and make it fail; what can still be read is replayed anyway, and a workload that cannot be
loaded is an ERROR row. A workload where nothing was compared (no stored engine outputs and
no candidate, an output with zero elements, an expected output with no finite value) FAILS,
and so does a definition without workloads. Nothing here lets an exception from dataset or
user code escape: it becomes a one-line message on the row it concerns. Candidates (each solution in its
own) and every reference (enginetap's own and trusted dataset ones) run in a child process
(:mod:`enginetap.replay.execution`) under the same timeout and memory limit, so that
``sys.exit``, ``KeyboardInterrupt``, ``os._exit``, a crash, a hang or an allocation past
the limit in them is an ERROR row too. A workload whose tensors, with the pages it gathers
(pages referenced x page size), would take more than the memory limit is an ERROR row
before anything runs. A solution that cannot run a
definition (:mod:`enginetap.replay.candidates`) gives SKIPPED rows, never a pass.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from enginetap import __version__
from enginetap.dataset import Dataset, validate_dataset
from enginetap.dataset.scan import scan_workloads
from enginetap.dataset.schema import Definition, WorkloadLine
from enginetap.definitions.base import (
    CompareRule,
    Template,
    compile_reference,
    family_of,
    params_of,
)
from enginetap.definitions.registry import known_template, templates
from enginetap.errors import ConfigError, DatasetError, EnginetapError
from enginetap.replay.compare import Comparison, compare_outputs, fallback_rule
from enginetap.replay.report import (
    NOT_EXPOSED,
    DefinitionResult,
    OutputCheck,
    ReplayOptions,
    ReplayReport,
    WorkloadResult,
    worst,
)
from enginetap.core.isolated import Child, one_line
from enginetap.replay.candidates import (
    Candidate,
    check_claims,
    close_candidates,
    open_candidates,
)
from enginetap.replay.execution import (
    Called,
    ChildFunction,
    FunctionFailed,
    Timing,
    child,
)
from enginetap.replay.solution import nbytes, poison_left

if TYPE_CHECKING:
    import torch

__all__ = ["replay_dataset"]

TRUST_FLAG = "--trust-dataset-code"


def replay_dataset(root: str | Path, *, definitions: Iterable[str] | None = None,
                   solution: str | Sequence[str] | None = None,
                   trust_dataset_code: bool = False,
                   device: str = "cpu", warmup: int = 1, repeats: int = 3,
                   timeout: float | None = 600.0, memory_limit: int | None | str = "auto",
                   progress: bool = False) -> ReplayReport:
    """Replay the dataset at ``root`` and return what every check found.

    ``definitions`` limits the replay to these names; ``solution`` is one candidate or a
    list of them, each a built-in name (``fla:gdn``, see ``enginetap.replay.builtin``) or a
    ``module:function``, to check and time against the reference, each in its own process.
    A call there that takes more than ``timeout`` seconds (None: no limit) is killed and
    reported as an ERROR for that workload; the next workload gets a fresh process.
    ``memory_limit`` bounds, in bytes, what one call may allocate and what a workload may
    expand to (``"auto"``: half of this machine's memory; None: no limit).

    Raises:
        ConfigError: bad device, counts or solution (it cannot be imported, or a user's
            function claims none of the replayed definitions, or claims nothing while they
            span several families: :func:`enginetap.replay.candidates.check_claims`).
        DatasetError: ``root`` is not a dataset.
    """
    import torch

    solutions = [solution] if isinstance(solution, str) else list(solution or [])
    options = ReplayOptions(dataset=str(root), definitions=list(definitions) if definitions
                            else None, solutions=solutions,
                            trust_dataset_code=trust_dataset_code,
                            device=device, warmup=warmup, repeats=repeats, timeout=timeout,
                            memory_limit=default_memory_limit() if memory_limit == "auto"
                            else memory_limit)
    _check_options(options)
    dataset = Dataset(root)
    candidates: list[Candidate] = []
    trusted = child()  # one process for every reference, started if needed
    try:
        candidates = open_candidates(solutions, timeout)
        report = ReplayReport(options=options, problems=validate_dataset(root),
                              created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                              enginetap_version=__version__, torch_version=torch.__version__)
        plan = _plan(dataset, options.definitions, report)
        check_claims(candidates, [definition for definition, _ in plan])
        with _Progress(progress, sum(len(lines) for _, lines in plan)) as bar:
            for definition, lines in plan:
                report.definitions.append(_replay_definition(
                    dataset, definition, lines, (candidates, trusted), options, bar.advance))
    finally:
        trusted.close()
        close_candidates(candidates)
    return report


def _check_options(options: ReplayOptions) -> None:
    import torch

    if options.warmup < 0 or options.repeats < 0:
        raise ConfigError("bad timing counts", "warmup and repeats must be >= 0",
                          "pass e.g. --warmup 1 --repeats 3")
    if options.timeout is not None and not options.timeout > 0:
        raise ConfigError(f"bad timeout {options.timeout}", "a call needs a positive limit",
                          "pass e.g. --timeout 600 (seconds), or 0 for no limit")
    if options.memory_limit is not None and not options.memory_limit > 0:
        raise ConfigError(f"bad memory limit {options.memory_limit}",
                          "a call needs a positive limit",
                          "pass e.g. --memory-limit 8 (GiB), or 0 for no limit")
    if options.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {options.device!r} is not available",
                          "this torch sees no CUDA device", "use --device cpu")
    if options.device != "cpu" and not options.device.startswith("cuda"):
        raise ConfigError(f"unknown device {options.device!r}", "", "use cpu or cuda")


def _plan(dataset: Dataset, names: list[str] | None,
          report: ReplayReport) -> list[tuple[Definition, list[WorkloadLine]]]:
    """The definitions to replay with their readable workload lines.

    Lines that do not parse are skipped (``validate_dataset`` lists them); a definition file
    that does not parse stops the replay, since the store then resolves no definition.
    """
    try:
        available = dataset.definitions()
    except DatasetError as exc:
        report.problems.append(f"nothing replayed: {exc}")
        return []
    lines: dict[str, list[WorkloadLine]] = {}
    for record in scan_workloads(dataset.root)[0]:
        lines.setdefault(record.line.definition, []).append(record.line)
    if not available:
        report.problems.append("nothing to replay: the dataset holds no definitions")
    plan = []
    for name in names or sorted(available):
        if name in available:
            plan.append((available[name], lines.get(name, [])))
        else:
            report.definitions.append(DefinitionResult(
                name=name, status="ERROR", message="no such definition in this dataset"))
    return plan


def default_memory_limit() -> int | None:
    """Half of this machine's physical memory (None where it cannot be read)."""
    import os

    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):
        return None


@dataclass
class _Reference:
    run: ChildFunction
    rules: dict[str, CompareRule]
    source: str


def _resolve_reference(definition: Definition, options: ReplayOptions,
                       trusted: Child) -> _Reference | str:
    """The reference to run for ``definition``, or the reason it is refused.

    It runs in the child process ``trusted``, like a candidate: enginetap's regenerated
    source, or the dataset's own when trusted.

    Raises:
        DefinitionError: enginetap's regenerated source defines no ``run``.
        FunctionFailed: the trusted source cannot be loaded (it raised or ended its process).
    """
    template = known_template(definition)
    if template is not None:
        ours = template.instantiate(**definition.const_axes, **params_of(definition, template))
        # Constraints decide which workloads are valid: edited ones make it foreign too.
        if ours.constraints == definition.constraints:
            compile_reference(ours.reference, definition.name)  # ours must define run
            return _Reference(_started(ChildFunction(trusted, reference=ours.reference,
                                                     name=definition.name), options),
                              _rules(definition, template), "enginetap")
    family = templates().get(family_of(definition) or "")
    if not options.trust_dataset_code:
        why = (f"its reference differs from what enginetap {__version__} generates for family "
               f"{family.family!r} (edited, or made by another enginetap version)"
               if family is not None else "its reference is not from a known enginetap family")
        return f"{why}; dataset code runs only with {TRUST_FLAG}"
    run = ChildFunction(trusted, reference=definition.reference, name=definition.name)
    return _Reference(_started(run, options), _rules(definition, family), "dataset")


def _started(run: ChildFunction, options: ReplayOptions) -> ChildFunction:
    try:
        run.start(options.timeout)
    except BaseException:
        run.close()
        raise
    return run


def _load_reference(definition: Definition, options: ReplayOptions,
                    trusted: Child) -> _Reference | DefinitionResult:
    """The reference to run, or the REFUSED/ERROR result of the whole definition."""
    try:
        reference = _resolve_reference(definition, options, trusted)
    except FunctionFailed as exc:
        return DefinitionResult(name=definition.name, status="ERROR",
                                message=f"its reference cannot be loaded: {exc}")
    except Exception as exc:  # e.g. a known family's regenerated source: report, go on
        return DefinitionResult(name=definition.name, status="ERROR",
                                message=f"its reference cannot be loaded: {one_line(exc)}")
    if isinstance(reference, str):
        return DefinitionResult(name=definition.name, status="REFUSED", message=reference)
    return reference


def _rules(definition: Definition, template: Template | None) -> dict[str, CompareRule]:
    from enginetap.dataset.dtypes import torch_dtype

    rules = {}
    for name, spec in definition.outputs.items():
        if template is not None and name in template.outputs:
            rules[name] = template.rule(name)
        else:
            rules[name] = fallback_rule(torch_dtype(spec.dtype))
    return rules


def _replay_definition(dataset: Dataset, definition: Definition, lines: list[WorkloadLine],
                       processes: tuple[list[Candidate], Child], options: ReplayOptions,
                       advance: Callable[[], None]) -> DefinitionResult:
    """``processes``: the candidates and the child for trusted references."""
    candidates, trusted = processes
    reference = _load_reference(definition, options, trusted)
    if isinstance(reference, DefinitionResult):
        for _ in lines:
            advance()
        return reference
    if not lines:  # nothing to run the reference (or a candidate) on: never a pass
        reference.run.close()
        ran = (f"; no --solution ran on it ({', '.join(c.name for c in candidates)})"
               if candidates else "")
        return DefinitionResult(name=definition.name, status="FAIL", reference=reference.source,
                                message=f"nothing replayed: the definition has no workloads "
                                        f"(readable ones) in this dataset{ran}")
    replay = _WorkloadReplay(dataset, definition, reference, candidates, options)
    results = []
    try:
        for line in lines:
            results.append(replay.run(line))
            advance()
    finally:
        reference.run.close()
    return DefinitionResult(name=definition.name, status=worst([w.status for w in results]),
                            reference=reference.source, workloads=results)


@dataclass
class _Workload:
    """One workload's data while it is replayed."""

    axes: dict[str, int]
    inputs: dict[str, Any]
    engine: dict[str, torch.Tensor]
    """Stored engine outputs (``{}`` when none)."""
    expected: dict[str, torch.Tensor]
    """The reference's outputs."""


class _WorkloadReplay:
    """Replays single workloads of one definition."""

    def __init__(self, dataset: Dataset, definition: Definition, reference: _Reference,
                 candidates: list[Candidate], options: ReplayOptions) -> None:
        self.dataset, self.definition, self.reference = dataset, definition, reference
        self.candidates, self.device = candidates, options.device
        # Decided once per definition, before anything runs: SKIPPED, never a pass.
        self.skipped = {c.name: c.skip_reason(definition, options.device) for c in candidates}
        self.timing = Timing(options.device, options.warmup, options.repeats, options.timeout,
                             options.memory_limit)

    def run(self, line: WorkloadLine) -> WorkloadResult:
        uuid, axes = line.workload.uuid, line.workload.axes
        too_big = _expansion_problem(self.definition, axes, self.timing.memory)
        if too_big is not None:
            return WorkloadResult(uuid=uuid, status="ERROR", axes=axes, message=too_big)
        try:
            inputs = self.dataset.load_inputs(line, self.device)
            engine = self.dataset.load_outputs(line, self.device)
        except EnginetapError as exc:
            return WorkloadResult(uuid=uuid, status="ERROR", axes=axes, message=str(exc))
        except Exception as exc:  # stored files are untrusted input; report, do not crash
            return WorkloadResult(uuid=uuid, status="ERROR", axes=axes,
                                  message=f"cannot load it: {one_line(exc)}")
        try:
            called = self.reference.run.call(self.definition, inputs, axes, self.timing)
            self._check_conforms(called.outputs, axes)
        except (FunctionFailed, ValueError) as exc:
            return WorkloadResult(uuid=uuid, status="ERROR", axes=axes,
                                  message=f"reference failed: {exc}")
        data = _Workload(axes, inputs, engine, called.outputs)
        checks = self._engine_checks(data)
        cand_ms: dict[str, float | None] = {}
        for candidate in self.candidates:
            checks += self._candidate_checks(candidate, data, cand_ms)
        checks = [self._verified_something(c, data) for c in checks]
        if all(c.status == "SKIPPED" for c in checks):
            checks.append(OutputCheck(output="-", check="reference", status="FAIL",
                                      message=self._nothing_compared()))
        return WorkloadResult(uuid=uuid, status=worst([c.status for c in checks]), axes=axes,
                              reference_ms=called.ms, candidate_ms=cand_ms, checks=checks)

    def _verified_something(self, check: OutputCheck, data: _Workload) -> OutputCheck:
        """``check``, or a FAIL when its PASS verified nothing: the output has zero elements,
        or its expected value holds no finite number (a NaN from anything matches NaN)."""
        if check.status != "PASS" or check.check not in ("engine", "candidate"):
            return check
        why = _verifies_nothing(check.output, data.expected[check.output], data.axes)
        if why is None:
            return check
        return check.model_copy(update={"status": "FAIL", "message": why})

    def _nothing_compared(self) -> str:
        # A replay that compared nothing proves nothing: it must not read as a PASS.
        if not self.definition.outputs:
            return "nothing compared: the definition has no outputs"
        return ("nothing compared: no engine outputs are stored for this workload and no "
                "--solution ran on it; only the reference ran")

    def _check_conforms(self, outputs: Mapping[str, torch.Tensor], axes: dict[str, int]) -> None:
        from enginetap.dataset.dtypes import name_of

        for name, spec in self.definition.outputs.items():
            shape = list(self.definition.shape_of(spec, axes) or ())
            got = outputs[name]
            if list(got.shape) != shape or name_of(got.dtype) != spec.dtype:
                raise ValueError(f"output {name!r} is {name_of(got.dtype)}{list(got.shape)}, "
                                 f"the definition says {spec.dtype}{shape}")

    def _engine_checks(self, data: _Workload) -> list[OutputCheck]:
        if not data.engine:
            return []
        checks = []
        for name in self.definition.outputs:
            if name not in data.engine:
                # Capture stores only what the engine computed (a kernel that returns no
                # lse leaves it out): the reference's output was shape-checked, not compared.
                checks.append(OutputCheck(output=name, check="reference", status="PASS",
                                          message=NOT_EXPOSED))
                continue
            comparison = self._compare(name, data.expected, data.engine, data)
            checks.append(OutputCheck(output=name, check="engine", comparison=comparison,
                                      status="PASS" if comparison.passed else "FAIL"))
        return checks

    def _candidate_checks(self, candidate: Candidate, data: _Workload,
                          times: dict[str, float | None]) -> list[OutputCheck]:
        """Run a candidate (in its child) once on poisoned memory and time it; compare.

        Its median time goes into ``times`` under its name.
        """
        name = candidate.name
        if self.skipped[name] is not None:
            return [OutputCheck(output="-", check="candidate", solution=name, status="SKIPPED",
                                message=self.skipped[name])]
        try:
            called = candidate.run.call(self.definition, data.inputs, data.axes, self.timing,
                                        scrub=nbytes(data.expected))
        except FunctionFailed as exc:  # whatever the candidate did, it is its ERROR row
            candidate.run.reset()  # and the next workload gets a fresh process (CUDA context)
            return [OutputCheck(output="-", check="candidate", solution=name, status="ERROR",
                                message=f"candidate failed: {exc}")]
        times[name] = called.ms
        return [self._candidate_check(output, called, data).model_copy(update={"solution": name})
                for output in self.definition.outputs]

    def _candidate_check(self, name: str, called: Called, data: _Workload) -> OutputCheck:
        actual = called.outputs
        comparison = self._compare(name, data.expected, actual, data)
        vs_engine = (self._compare(name, data.engine, actual, data)
                     if name in data.engine else None)
        unwritten = poison_left(actual[name], data.expected[name]) if called.destination else 0
        message = (f"{unwritten} element(s) never written (still poison)" if unwritten
                   else None)
        passed = comparison.passed and not unwritten
        return OutputCheck(output=name, check="candidate", status="PASS" if passed else "FAIL",
                           comparison=comparison, vs_engine=vs_engine, message=message)

    def _compare(self, name: str, expected_side: Mapping[str, torch.Tensor],
                 actual_side: Mapping[str, torch.Tensor], data: _Workload) -> Comparison:
        """Compare output ``name`` of two sides (reference, engine or candidate outputs)."""
        rule = self.reference.rules[name]
        expected, actual = expected_side[name], actual_side[name]
        scores = None
        if rule.scores:
            # The scores name an input, or else an output: then the reference's value.
            scores = data.inputs.get(rule.scores, data.expected.get(rule.scores))
        pairs = None
        if rule.paired_with and rule.paired_with in expected_side and rule.paired_with in actual_side:
            pairs = (expected_side[rule.paired_with], actual_side[rule.paired_with])
        try:
            return compare_outputs(rule, expected, actual, pairs=pairs,
                                   scores=scores if hasattr(scores, "shape") else None)
        except Exception as exc:  # e.g. a dtype torch cannot do arithmetic on here
            return Comparison(kind=rule.kind, passed=False, shape=list(expected.shape),
                              dtype=str(expected.dtype).removeprefix("torch."),
                              reason=f"cannot compare: {one_line(exc)}", matched_ratio=0.0)


_PAGE_AXES = ("num_pages", "page_size")


def _expansion_problem(definition: Definition, axes: Mapping[str, int],
                       limit: int | None) -> str | None:
    """Why the workload would take more than ``limit`` bytes, or None.

    Counted before anything is loaded, from the axes alone: every declared input and output,
    plus, for a paged definition (``kv_indices`` into caches shaped ``[num_pages,
    page_size, ...]``), the pages it gathers: each index is a page the reference copies,
    however often it repeats.
    """
    import math

    from enginetap.dataset.dtypes import torch_dtype

    if limit is None:
        return None
    try:
        shapes = {name: definition.shape_of(spec, dict(axes)) or ()
                  for name, spec in (*definition.inputs.items(), *definition.outputs.items())}
    except KeyError:  # axes that do not fit: validation reports it, loading fails on it
        return None
    specs = {**definition.inputs, **definition.outputs}
    sizes = {name: math.prod(shape) * torch_dtype(specs[name].dtype).itemsize
             for name, shape in shapes.items()}
    total, gathered, referenced = sum(sizes.values()), 0, 0
    if "kv_indices" in definition.inputs:
        referenced = math.prod(shapes["kv_indices"])
        per_page = sum(sizes[name] // shapes[name][0] for name, spec in definition.inputs.items()
                       if tuple(spec.shape or ())[:2] == _PAGE_AXES and shapes[name][0])
        gathered = referenced * per_page
    if total + gathered <= limit:
        return None
    detail = (f" ({total >> 20} MiB of tensors, {gathered >> 20} MiB gathered from "
              f"{referenced} pages referenced)" if gathered else "")
    return (f"not run: the workload would take {(total + gathered) >> 20} MiB{detail}, more "
            f"than the memory limit of {limit >> 20} MiB; pass --memory-limit to raise it")


def _verifies_nothing(name: str, expected: torch.Tensor, axes: Mapping[str, int]) -> str | None:
    """Why a comparison with ``expected`` proves nothing, or None when it proves something."""
    import torch

    if expected.numel() == 0:
        where = " ".join(f"{k}={v}" for k, v in axes.items()) or "its const axes"
        return (f"nothing compared: output {name!r} has zero elements (shape "
                f"{list(expected.shape)} from {where}); a zero-element workload verifies nothing")
    packed = getattr(torch, "float4_e2m1fn_x2", None)
    if expected.dtype.is_floating_point and expected.dtype != packed:
        if not bool(torch.isfinite(expected.to(torch.float32)).any()):
            return (f"nothing finite compared: the expected {name!r} holds no finite value "
                    "(all NaN/inf), so any NaN-returning code matches it")
    return None


class _Progress:
    """A rich progress bar over workloads, or nothing."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled, self.total = enabled, total

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import Progress

            # stderr, so that the table on stdout stays clean when redirected.
            self._bar = Progress(console=Console(stderr=True), transient=True)
            self._bar.start()
            self._task = self._bar.add_task("replaying workloads", total=self.total)
        return self

    def advance(self) -> None:
        if self.enabled:
            self._bar.advance(self._task)

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._bar.stop()
