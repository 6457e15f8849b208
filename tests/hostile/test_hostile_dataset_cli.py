"""`enginetap dataset validate|show` never report success for a non-dataset, and print
names and paths from data literally (no rich markup read into them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import enginetap
from enginetap.cli.main import app
from enginetap.dataset import Dataset
from enginetap.dataset.schema import Receipt
from tests.dataset.dataset_helpers import copy_definition

RECEIPT = Receipt(source="manual", created_at="2026-01-02T03:04:05Z")
# Subprocesses run elsewhere than the repository: give them this very enginetap.
ENV = {**os.environ, "COLUMNS": "400", "PYTHONPATH": os.pathsep.join(
    [str(Path(enginetap.__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "enginetap.cli.main", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120, env=ENV)


def _dataset(root: Path) -> Dataset:
    dataset = Dataset(root, create=True)
    dataset.add_workload(copy_definition(), {"x": torch.ones(2, 4), "n": 1, "alpha": 0.5,
                                             "flag": True}, receipt=RECEIPT)
    return dataset


@pytest.mark.parametrize("command", ["validate", "show"])
def test_a_non_dataset_is_exit_2_with_one_line(tmp_path, command):
    empty = tmp_path / "empty"
    empty.mkdir()
    _dataset(tmp_path / "ds")
    cases = {
        str(empty): f"error: {empty} is not a dataset: it holds none of definitions/, "
                    "workloads/, blob/. Fix: give the root directory of a dataset (the one holding "
                    "definitions/)",
        str(tmp_path / "ds/definitions"): f"error: {tmp_path / 'ds/definitions'} is not a "
                    "dataset: it holds none of definitions/, workloads/, blob/. Fix: give the "
                    f"dataset root {tmp_path / 'ds'}, not its definitions/ directory",
        "": "error: no dataset path given: the path is empty. Fix: give the dataset root "
            "directory",
    }
    for path, message in cases.items():
        done = _cli("dataset", command, path, cwd=tmp_path / "ds")  # "" is not the cwd
        assert done.returncode == 2, (path, done.stdout)
        assert done.stdout == "" and "OK" not in done.stderr
        assert done.stderr.strip().splitlines() == [message]


def test_parallel_creation_of_one_dataset_never_fails(tmp_path):
    # Several processes creating the same root at the same moment (they spin until a
    # common start time, after their imports): every one must succeed.
    code = ("import sys, time\nfrom enginetap.dataset import Dataset\n"
            "while time.time() < float(sys.argv[2]):\n    pass\n"
            "Dataset(sys.argv[1], create=True)\n")
    for attempt in range(3):
        root = tmp_path / f"race{attempt}" / "deep" / "ds"
        start = str(time.time() + 1.5)
        procs = [subprocess.Popen([sys.executable, "-c", code, str(root), start], env=ENV,
                                  stderr=subprocess.PIPE, text=True) for _ in range(6)]
        errors = [p.communicate(timeout=120)[1] for p in procs]
        assert [p.returncode for p in procs] == [0] * 6, errors
        assert Dataset(root).root == root.resolve()


def test_show_prints_markup_in_names_and_paths_literally(tmp_path):
    root = tmp_path / "runs" / "[exp1]" / "ds"
    dataset = _dataset(root)
    # A name that cannot be a file name (so no writer makes it), placed by hand.
    record = json.loads(dataset.definition("tiny_copy_float32_h4").model_dump_json())
    record.update(name="rms[/]norm", op_type="[bold]x[/bold]")
    (dataset.root / "definitions/tiny_copy/odd.json").write_text(json.dumps(record))

    result = CliRunner().invoke(app, ["dataset", "show", str(root)], env={"COLUMNS": "300"})
    assert result.exception is None, result.output
    assert "rms[/]norm" in result.stdout and "[bold]x[/bold]" in result.stdout
    assert "[exp1]" in result.stdout
    validate = CliRunner().invoke(app, ["dataset", "validate", str(root)])
    assert "definitions/tiny_copy/odd.json: definition 'rms[/]norm'" in validate.stdout
