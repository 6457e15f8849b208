"""Replays that verify nothing, or verify the wrong thing, must never read as a PASS.

Zero-element workloads, definitions without workloads, empty datasets, an interrupted
capture, expected outputs without a finite value, and a definition whose inputs were
reordered (so that enginetap's reference would bind its arguments to the wrong tensors).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from enginetap.dataset import Dataset, validate_dataset
from enginetap.definitions import get_template
from enginetap.replay import replay_dataset
from enginetap.replay.render import summary_line
from enginetap.replay.synth import synthesize
from tests.replay.replay_helpers import receipt

_GARBAGE = '''import torch


def run(hidden_states, weight, eps):
    return torch.full(hidden_states.shape, float("nan"), dtype=hidden_states.dtype)
'''


def _garbage(tmp_path: Path) -> str:
    path = tmp_path / "garbage.py"
    path.write_text(_GARBAGE)
    return f"{path}:run"


def _rmsnorm(root: Path, rows: int, *, fill: float | None = None) -> Dataset:
    dataset = Dataset(root, create=True)
    definition = get_template("rmsnorm").example_definition()
    x = torch.randn(rows, 128).to(torch.bfloat16)
    if fill is not None:
        x.fill_(fill)
    w = torch.randn(128).to(torch.bfloat16)
    from enginetap.definitions.base import compile_reference

    out = compile_reference(definition.reference, definition.name)(x.clone(), w.clone(), 1e-6)
    dataset.add_workload(definition, {"hidden_states": x, "weight": w, "eps": 1e-6},
                         outputs={"output": out}, receipt=receipt())
    return dataset


def _messages(report) -> list[str]:
    return [c.message or "" for d in report.definitions for w in d.workloads
            for c in w.checks] + [w.message or "" for d in report.definitions
                                  for w in d.workloads] + [d.message or ""
                                                           for d in report.definitions]


def test_a_zero_element_workload_compares_nothing_and_fails(tmp_path: Path) -> None:
    dataset = _rmsnorm(tmp_path / "ds", rows=0)
    for solution in (None, _garbage(tmp_path)):
        report = replay_dataset(dataset.root, solution=solution, warmup=0, repeats=0)
        assert not report.ok, summary_line(report)
        assert report.definitions[0].status == "FAIL"
        assert any("nothing compared" in m and "zero elements" in m
                   for m in _messages(report)), _messages(report)


def test_a_definition_without_workloads_is_not_a_pass(tmp_path: Path) -> None:
    dataset = Dataset(tmp_path / "ds", create=True)
    dataset.write_definition(get_template("rmsnorm").example_definition())
    report = replay_dataset(dataset.root, solution=_garbage(tmp_path), warmup=0, repeats=0)
    assert not report.ok, summary_line(report)
    (result,) = report.definitions
    assert result.status == "FAIL" and "no workloads" in (result.message or "")
    assert all(row.status != "PASS" for row in report.summary), report.summary


def test_an_empty_dataset_is_not_ok(tmp_path: Path) -> None:
    dataset = Dataset(tmp_path / "ds", create=True)
    report = replay_dataset(dataset.root, warmup=0, repeats=0)
    assert not report.ok
    assert summary_line(report).startswith("not ok: nothing to replay"), summary_line(report)


def test_an_interrupted_capture_is_a_problem(tmp_path: Path) -> None:
    dataset = _rmsnorm(tmp_path / "ds", rows=2)
    run = dataset.root / "enginetap"
    run.mkdir()
    (run / "capture-run.json").write_text(json.dumps(
        {"status": "failed", "reason": "KeyboardInterrupt", "engine": "builtin"}))
    problems = validate_dataset(dataset.root)
    assert any("did not complete" in p and "KeyboardInterrupt" in p for p in problems), problems
    report = replay_dataset(dataset.root, warmup=0, repeats=0)
    assert not report.ok
    # A capture still running (or killed -9) says so too.
    (run / "capture-run.json").write_text(json.dumps({"status": "running"}))
    assert any("did not complete" in p for p in validate_dataset(dataset.root))
    (run / "capture-run.json").write_text(json.dumps({"status": "complete"}))
    assert validate_dataset(dataset.root) == []
    (run / "capture-run.json").write_text("{not json")
    assert any("capture-run.json" in p for p in validate_dataset(dataset.root))


def test_all_nan_expected_outputs_verify_nothing(tmp_path: Path) -> None:
    dataset = _rmsnorm(tmp_path / "ds", rows=3, fill=float("nan"))
    report = replay_dataset(dataset.root, solution=_garbage(tmp_path), warmup=0, repeats=0)
    assert not report.ok, summary_line(report)
    checks = [c for w in report.definitions[0].workloads for c in w.checks]
    assert checks and all(c.status == "FAIL" for c in checks), checks
    assert all("nothing finite compared" in (c.message or "") for c in checks), checks


def test_a_reordered_definition_is_refused(tmp_path: Path) -> None:
    dataset = Dataset(tmp_path / "ds", create=True)
    synthesize(dataset, get_template("rmsnorm"), workloads=1, seed=1)
    (path,) = (dataset.root / "definitions").rglob("*.json")
    data = json.loads(path.read_text())
    # Same dict, other order: a reference bound by position would swap the arguments.
    data["inputs"] = dict(reversed(list(data["inputs"].items())))
    path.write_text(json.dumps(data))
    report = replay_dataset(dataset.root, warmup=0, repeats=0)
    (result,) = report.definitions
    assert result.status == "REFUSED", result
    assert not report.ok
