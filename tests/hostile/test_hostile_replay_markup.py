"""Rich markup in dataset data (uuids, names, paths) is printed literally, never read."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from enginetap.dataset import Dataset
from enginetap.definitions import get_template
from enginetap.replay.compare import Comparison
from enginetap.replay.render import print_report
from enginetap.replay.results import (
    DefinitionResult,
    OutputCheck,
    ReplayOptions,
    ReplayReport,
    WorkloadResult,
)
from enginetap.replay.synth import synthesize


def test_markup_in_a_uuid_and_a_dataset_path_is_printed_as_is(tmp_path: Path) -> None:
    dataset = Dataset(tmp_path / "runs" / "[exp1]" / "ds", create=True)
    synthesize(dataset, get_template("rmsnorm"), workloads=1, seed=3)
    jsonl = next((dataset.root / "workloads").rglob("*.jsonl"))
    line = json.loads(jsonl.read_text())
    line["workload"]["uuid"] = "[/]" + line["workload"]["uuid"]
    jsonl.write_text(json.dumps(line) + "\n")
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "enginetap.cli.main", "replay", "runs/[exp1]/ds", "--repeats", "0",
         "--json", str(report)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "COLUMNS": "200"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert line["workload"]["uuid"][:8] in done.stdout and "ok: 1 PASS" in done.stdout
    assert json.loads(report.read_text())["ok"] is True


def test_markup_in_definition_and_output_names_is_printed_as_is() -> None:
    comparison = Comparison(kind="float", passed=True, shape=[2], dtype="float32",
                            max_abs_error=0.0, max_rel_error=0.0, matched=2, total=2)
    check = OutputCheck(output="[red]y", check="engine", status="PASS", comparison=comparison)
    report = ReplayReport(
        options=ReplayOptions(dataset="runs/[exp1]/ds"),
        definitions=[DefinitionResult(name="rms[/]norm[bold]", status="PASS",
                                      reference="dataset", workloads=[WorkloadResult(
                                          uuid="[/]0123456789", status="PASS", checks=[check])])],
        created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        enginetap_version="test", torch_version="test")
    console = Console(record=True, width=200, force_terminal=False)
    print_report(console, report)
    text = console.export_text()
    assert "rms[/]norm[bold]  PASS" in text
    assert "[/]01234" in text and "[red]y" in text
