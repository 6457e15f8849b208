"""`enginetap dataset validate|show`: output, exit codes, and the missing-path error."""

from __future__ import annotations

import os
import subprocess
import sys

from typer.testing import CliRunner

from enginetap.cli.dataset import human_bytes
from enginetap.cli.main import app
from enginetap.errors import DatasetError
from tests.dataset.dataset_helpers import copy_definition

runner = CliRunner()


def _fill(dataset, receipt, copy_inputs) -> None:
    definition = copy_definition()
    first = copy_inputs(batch=2)
    dataset.add_workload(definition, first, outputs={"y": first["x"]}, receipt=receipt)
    dataset.add_workload(definition, copy_inputs(batch=5), receipt=receipt)


def test_validate_ok_prints_counts(dataset, receipt, copy_inputs):
    _fill(dataset, receipt, copy_inputs)
    result = runner.invoke(app, ["dataset", "validate", str(dataset.root)])
    assert result.exit_code == 0, result.output
    assert result.stdout == (f"OK {dataset.root}: 1 definition(s), 2 workload(s), "
                             "1 with engine outputs\n")


def test_validate_lists_problems_one_per_line_and_exits_1(dataset, receipt, copy_inputs):
    _fill(dataset, receipt, copy_inputs)
    jsonl = dataset.root / "workloads/tiny_copy/tiny_copy_float32_h4.jsonl"
    with open(jsonl, "a") as f:
        f.write("not json\n")
    (dataset.root / "blob/workloads/tiny_copy/stray.bin").write_bytes(b"x" * 300)
    result = runner.invoke(app, ["dataset", "validate", str(dataset.root)])
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("workloads/tiny_copy/tiny_copy_float32_h4.jsonl:3: malformed JSON")
    assert lines[1].startswith("blob/workloads/tiny_copy/stray.bin: orphan blob")
    assert "2 problem(s)" in result.stderr


def test_show_prints_a_table_per_definition(dataset, receipt, copy_inputs):
    _fill(dataset, receipt, copy_inputs)
    dataset.write_definition(copy_definition("int8"))
    result = runner.invoke(app, ["dataset", "show", str(dataset.root)],
                           env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in result.stdout.splitlines() if line.count("│") == 7}
    size = rows["tiny_copy_float32_h4"][2]
    assert rows["tiny_copy_float32_h4"] == ["tiny_copy", "2", size, "2", "1"]
    assert size.endswith("KiB")
    assert rows["tiny_copy_int8_h4"][:2] == ["tiny_copy", "0"]


def test_missing_path_raises_a_dataset_error(tmp_path):
    result = runner.invoke(app, ["dataset", "show", str(tmp_path / "nope")])
    assert isinstance(result.exception, DatasetError)


def test_missing_path_is_one_line_and_exit_2(tmp_path):
    missing = tmp_path / "nonexistent"
    done = subprocess.run(
        [sys.executable, "-m", "enginetap.cli.main", "dataset", "validate", str(missing)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "400"})
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"error: no dataset at {missing}: the directory does not exist. Fix: give the root "
        "directory of an existing dataset"]


def test_human_bytes():
    assert [human_bytes(n) for n in (0, 1023, 1536, 5 * 2**20, 3 * 2**40, 2**52)] == \
        ["0 B", "1023 B", "1.5 KiB", "5.0 MiB", "3.0 TiB", "4096.0 TiB"]
