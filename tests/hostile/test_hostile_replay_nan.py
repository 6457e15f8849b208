"""A FAIL caused by NaN (or inf) mismatches never reads as an error of 0."""

from __future__ import annotations

import datetime

import torch
from rich.console import Console

from enginetap.definitions.base import CompareRule
from enginetap.replay.compare import compare_outputs
from enginetap.replay.render import print_report, problem_lines
from enginetap.replay.results import (
    DefinitionResult,
    OutputCheck,
    ReplayOptions,
    ReplayReport,
    WorkloadResult,
)


def test_expected_nan_missing_from_the_actual_output() -> None:
    expected = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    actual = expected.clone()
    expected[1, 2] = float("nan")
    expected[2, 0] = float("inf")
    result = compare_outputs(CompareRule(kind="float"), expected, actual)
    assert not result.passed and result.max_abs_error == 0.0  # over finite elements only
    assert result.missing_nan == 1 and result.unexpected_nan == 0 and result.nonfinite == 2
    assert result.first_mismatch == "[1, 2]: expected nan, got 6"
    assert result.reason == ("2 of 12 elements differ (1 number(s) where NaN expected); "
                             "first at [1, 2]: expected nan, got 6")
    check = OutputCheck(output="y", check="engine", status="FAIL", comparison=result)
    report = ReplayReport(
        options=ReplayOptions(dataset="ds"),
        definitions=[DefinitionResult(name="scale_d4", status="FAIL", workloads=[
            WorkloadResult(uuid="0123456789", status="FAIL", checks=[check])])],
        created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        enginetap_version="test", torch_version="test")
    console = Console(record=True, width=200, force_terminal=False)
    print_report(console, report)
    row = next(line for line in console.export_text().splitlines() if "01234567" in line)
    assert row.split()[2:7] == ["FAIL", "failing", "2", "NaN/inf", "2"], row
    assert "first at [1, 2]: expected nan, got 6" in problem_lines(report)[0]
