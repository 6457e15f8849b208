"""Hostile definitions: constraints and sources that would cost unbounded time or memory.

Each crafted definition must become one problem line (never a hang, a RecursionError or
a MemoryError), and an edited definition must no longer count as enginetap's own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from enginetap.dataset import Dataset, validate_dataset
from enginetap.dataset.constraints import evaluate, violations
from enginetap.dataset.schema import Definition, Receipt
from enginetap.definitions import get_template
from enginetap.errors import DatasetError
from enginetap.replay import replay_dataset
from enginetap.replay.synth import synthesize
from tests.dataset.dataset_helpers import copy_definition

DEFINITION = "definitions/tiny_copy/tiny_copy_float32_h4.json"
RECEIPT = Receipt(source="manual", created_at="2026-01-02T03:04:05Z")


def _dataset_with(tmp_path: Path, **edits: object) -> Path:
    """A one-workload dataset whose definition file is then rewritten with ``edits``."""
    import torch

    dataset = Dataset(tmp_path / "ds", create=True)
    inputs = {"x": torch.ones(3, 4), "n": 1, "alpha": 0.5, "flag": True}
    dataset.add_workload(copy_definition(), inputs, receipt=RECEIPT)
    path = dataset.root / DEFINITION
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, **edits}))
    return dataset.root


def _definition_problems(problems: list[str]) -> list[str]:
    return [p for p in problems if p.startswith(DEFINITION)]


def test_nested_powers_do_not_hang_validate(tmp_path):
    root = _dataset_with(tmp_path, constraints=["((((batch**64)**64)**64)**64) > 0"])
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "enginetap.cli.main", "dataset", "validate", str(root)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "400"})
    assert time.monotonic() - started < 60
    assert done.returncode == 1, done.stderr
    (line,) = done.stdout.splitlines()  # the one workload breaks it: its line says why
    assert line.startswith("workloads/tiny_copy/tiny_copy_float32_h4.jsonl:1: constraint ")
    assert "cannot be evaluated" in line and "larger in magnitude than 2**256" in line
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("expression", [
    " + ".join(["batch"] * 2000) + " > 0",  # 2,000 chained terms
    "-" * 900 + "batch > 0",  # deep unary nesting within the length limit
])
def test_hostile_constraints_are_one_problem_line(tmp_path, expression):
    root = _dataset_with(tmp_path, constraints=[expression])
    problems = validate_dataset(root)
    (line,) = _definition_problems(problems)
    assert "constraints.0" in line
    assert len(line) < 400  # the expression is shortened, not echoed whole
    with pytest.raises(DatasetError, match="constraints.0"):
        Dataset(root).definitions()
    report = replay_dataset(root, warmup=0, repeats=0)  # no RecursionError escapes
    assert not report.ok


def test_evaluation_is_bounded_whatever_the_values():
    assert evaluate("n ** 3 == 27", {"n": 3})
    started = time.monotonic()
    for expression, names in [("(n ** 64) ** 64 > 0", {"n": 3}),
                              ("n * n * n * n > 0", {"n": 2 ** 200}),
                              ("0.5 ** -100000 > 1", {}),
                              ("2 ** 2 ** 2 ** 2 ** 2 ** 2 > 0", {}),
                              ("(-8) ** 0.5 > 0", {})]:
        (message,) = violations([expression], names)
        assert "cannot be evaluated" in message
    assert violations(["n > 0"], {"n": 10 ** 5000})[0].startswith("constraint 'n > 0' cannot")
    assert time.monotonic() - started < 1


def test_too_many_constraints_are_refused(tmp_path):
    root = _dataset_with(tmp_path, constraints=["batch >= 0"] * 65)
    (line,) = _definition_problems(validate_dataset(root))
    assert "65 of them, more than the limit of 64" in line


def test_a_huge_reference_is_refused_before_parsing(tmp_path):
    source = "def run(x, n, alpha, flag):\n    return x\n" + "# padding\n" * 120_000
    root = _dataset_with(tmp_path, reference=source)
    (line,) = _definition_problems(validate_dataset(root))
    assert "reference:" in line and "more than the limit" in line


def test_a_deeply_nested_reference_is_one_problem_line(tmp_path):
    source = "def run(x, n, alpha, flag):\n    return x\n\ny = " + "-" * 100_000 + "1\n"
    root = _dataset_with(tmp_path, reference=source)
    (line,) = _definition_problems(validate_dataset(root))
    assert "reference: nested too deeply to parse" in line


def test_an_oversized_definition_file_is_not_read(tmp_path):
    root = _dataset_with(tmp_path, description="x" * (9 << 20))
    (line,) = _definition_problems(validate_dataset(root))
    assert "more than the 8388608-byte limit" in line


def test_edited_constraints_make_a_definition_foreign(tmp_path):
    dataset = Dataset(tmp_path / "ds", create=True)
    definition = synthesize(dataset, get_template("rmsnorm"), workloads=1, seed=3)
    assert replay_dataset(dataset.root, warmup=0, repeats=0).definitions[0].status == "PASS"
    path = dataset.root / f"definitions/{definition.op_type}/{definition.name}.json"
    record = json.loads(path.read_text())
    record["constraints"] = [*record["constraints"], "1 == 1"]
    path.write_text(json.dumps(record))
    assert Definition.model_validate(record).reference == definition.reference  # only them

    (result,) = replay_dataset(dataset.root, warmup=0, repeats=0).definitions
    assert result.status == "REFUSED" and "--trust-dataset-code" in result.message
    trusted = replay_dataset(dataset.root, warmup=0, repeats=0, trust_dataset_code=True)
    assert trusted.definitions[0].status == "PASS"
    assert trusted.definitions[0].reference == "dataset"


def test_a_refused_definition_is_not_buried_under_its_workloads(tmp_path):
    import torch

    dataset = Dataset(tmp_path / "ds", create=True)
    for rows in range(1, 6):
        dataset.add_workload(copy_definition(), {"x": torch.ones(rows, 4), "n": 1,
                                                 "alpha": 0.5, "flag": True}, receipt=RECEIPT)
    path = dataset.root / DEFINITION
    path.write_text(json.dumps({**json.loads(path.read_text()), "constraints": ["(" * 300]}))
    problems = validate_dataset(dataset.root)
    assert len(problems) == 2, problems
    assert problems[0].startswith(f"{DEFINITION}: does not match the schema")
    assert problems[1] == (
        "workloads/tiny_copy/tiny_copy_float32_h4.jsonl:1: unknown definition "
        "'tiny_copy_float32_h4' (no readable definition file holds it; known: none); so do "
        "4 more line(s) of this file; 1 definition file(s) cannot be read, see their lines")
