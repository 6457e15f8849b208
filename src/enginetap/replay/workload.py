"""Replaying one workload of a definition: load its stored inputs and engine outputs, run
the reference, compare it with the engine's outputs and with each candidate's, and turn
every failure into a row (see :mod:`enginetap.replay.runner`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from enginetap.core.isolated import one_line
from enginetap.dataset import Dataset
from enginetap.dataset.schema import Definition, WorkloadLine
from enginetap.errors import EnginetapError
from enginetap.replay.candidates import Candidate
from enginetap.replay.compare import Comparison, compare_outputs
from enginetap.replay.execution import Called, FunctionFailed, Timing
from enginetap.replay.references import Reference
from enginetap.replay.results import (
    NOT_EXPOSED,
    OutputCheck,
    ReplayOptions,
    WorkloadResult,
    worst,
)
from enginetap.replay.solution import nbytes, poison_left

if TYPE_CHECKING:
    import torch

__all__ = ["WorkloadReplay"]


@dataclass
class _Workload:
    """One workload's data while it is replayed."""

    axes: dict[str, int]
    inputs: dict[str, Any]
    engine: dict[str, torch.Tensor]
    """Stored engine outputs (``{}`` when none)."""
    expected: dict[str, torch.Tensor]
    """The reference's outputs."""


class WorkloadReplay:
    """Replays single workloads of one definition."""

    def __init__(self, dataset: Dataset, definition: Definition, reference: Reference,
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
