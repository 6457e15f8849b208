"""The demo job as a function: what it tells its view, in order, and the result it returns
(the CLI's output over the same run is tests/cli/test_demo_cli.py)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from enginetap.definitions.base import family_of
from enginetap.jobs.demo import MARKER, DemoJob, run_demo, verdict_of
from enginetap.replay.compare import Comparison
from enginetap.replay.results import NOT_EXPOSED, DefinitionResult, OutputCheck, WorkloadResult


class _Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def building(self, index: int, name: str) -> contextlib.AbstractContextManager[None]:
        self.events.append(("building", index, name))
        return contextlib.nullcontext()

    def captured(self, name: str, root: Path, result: Any) -> None:
        self.events.append(("captured", name, root.name, result.status))

    def validated(self, root: Path, problems: list[str]) -> None:
        self.events.append(("validated", root.name, tuple(problems)))

    def replayed(self, replay: Any) -> None:
        self.events.append(("replayed", replay.root.name, replay.ok))


def test_run_demo_tells_each_step_and_returns_the_verdicts(tmp_path: Path) -> None:
    view = _Recorder()
    result = run_demo(DemoJob(tmp_path / "out", ["llama"], max_output_tokens=2,
                              capture_progress=False), view)
    assert view.events == [("building", 1, "llama"), ("captured", "llama", "llama", "complete"),
                           ("validated", "llama", ()), ("replayed", "llama", True)]
    assert result.ok and [r.root for r in result.replays] == [tmp_path / "out/dataset/llama"]
    verdicts = {v.name: v for v in result.replays[0].verdicts}
    assert verdicts["rmsnorm_h128_bfloat16_round_twice"].verdict == "PASS"
    assert all(v.workloads > 0 for v in verdicts.values())
    assert result.next_root == tmp_path / "out/dataset/llama"
    assert result.next_definition is not None and family_of(result.next_definition) == "rmsnorm"
    # the marker lists exactly the files written under dataset/: a re-run may delete them
    listed = json.loads((tmp_path / "out" / MARKER).read_text())["dataset_files"]
    written = sorted(str(p.relative_to(tmp_path / "out/dataset"))
                     for p in (tmp_path / "out/dataset").rglob("*") if p.is_file())
    assert listed == written


def _check(status: str, message: str | None = None, error: float | None = None) -> OutputCheck:
    comparison = None if error is None else Comparison(
        kind="float", passed=status == "PASS", shape=[1], dtype="float32", max_abs_error=error)
    return OutputCheck(output="out", check="engine", status=status, message=message,
                       comparison=comparison)


def test_verdicts_tell_inputs_only_unexposed_and_failures_apart() -> None:
    def result(status: str, *checks: OutputCheck) -> DefinitionResult:
        return DefinitionResult(name="d", status=status, workloads=[
            WorkloadResult(uuid="u", status=status, checks=list(checks))])

    passed = verdict_of(result("PASS", _check("PASS", error=0.5), _check("PASS", error=0.25)))
    assert (passed.verdict, passed.worst, passed.note, passed.workloads) == ("PASS", "0.5", "", 1)
    hidden = verdict_of(result("PASS", _check("PASS", NOT_EXPOSED)))
    assert (hidden.verdict, hidden.note) == ("PASS", "out: not exposed by this engine")
    inputs = verdict_of(result("SKIPPED", _check("SKIPPED", "nothing compared: no output")))
    assert (inputs.verdict, inputs.worst) == ("INPUTS ONLY", "-")
    failed = verdict_of(result("FAIL", _check("PASS", error=0.1),
                               _check("FAIL", "max abs 3 > atol", error=3.0)))
    assert (failed.verdict, failed.note, failed.worst) == ("FAIL", "max abs 3 > atol", "3")
