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
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from enginetap import __version__
from enginetap.core.isolated import Child
from enginetap.dataset import Dataset, validate_dataset
from enginetap.dataset.scan import scan_workloads
from enginetap.dataset.schema import Definition, WorkloadLine
from enginetap.errors import ConfigError, DatasetError
from enginetap.replay.candidates import (
    Candidate,
    check_claims,
    close_candidates,
    open_candidates,
)
from enginetap.replay.execution import child
from enginetap.replay.references import load_reference
from enginetap.replay.results import (
    DefinitionResult,
    ReplayOptions,
    ReplayReport,
    worst,
)
from enginetap.replay.workload import WorkloadReplay

__all__ = ["replay_dataset"]


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


def _replay_definition(dataset: Dataset, definition: Definition, lines: list[WorkloadLine],
                       processes: tuple[list[Candidate], Child], options: ReplayOptions,
                       advance: Callable[[], None]) -> DefinitionResult:
    """``processes``: the candidates and the child for trusted references."""
    candidates, trusted = processes
    reference = load_reference(definition, options, trusted)
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
    replay = WorkloadReplay(dataset, definition, reference, candidates, options)
    results = []
    try:
        for line in lines:
            results.append(replay.run(line))
            advance()
    finally:
        reference.run.close()
    return DefinitionResult(name=definition.name, status=worst([w.status for w in results]),
                            reference=reference.source, workloads=results)


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
