"""`enginetap replay` from the command line: table lines, JSON report, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from enginetap.cli.main import main
from tests.replay.replay_helpers import CANDIDATES, Built


def _cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
         *args: str) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["enginetap", "replay", *args])
    with pytest.raises(SystemExit) as exited:
        main()
    captured = capsys.readouterr()
    return exited.value.code, captured.out + captured.err


def test_bad_dataset_and_raising_candidate_report_lines_not_tracebacks(
        rmsnorm_dataset: Built, tmp_path: Path) -> None:
    built = rmsnorm_dataset
    first, second = built.dataset.workloads(built.definition.name)
    (built.root / first.workload.inputs["weight"].path).unlink()
    jsonl = next((built.root / "workloads").rglob("*.jsonl"))
    ghost = second.model_copy(update={"definition": "ghost_def"}).model_dump_json()
    with jsonl.open("a") as f:
        f.write("{not json\n" + ghost + "\n")
    report = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, "-m", "enginetap.cli.main", "replay", str(built.root), "--repeats", "1",
         "--solution", f"{CANDIDATES}:raising", "--json", str(report)],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "COLUMNS": "200"})  # rich wraps long lines at the terminal width
    output = run.stdout + run.stderr
    assert run.returncode == 1, output
    assert "Traceback" not in output
    lines = output.splitlines()
    assert any(line.startswith("PROBLEM ") and "malformed JSON" in line for line in lines)
    assert any(line.startswith("PROBLEM ") and "ghost_def" in line for line in lines)
    assert any(line.startswith(f"ERROR rmsnorm_h128_bfloat16_round_twice workload {first.workload.uuid}: cannot load")
               for line in lines)
    assert "candidate failed: ValueError: kernel not built for this shape" in output
    data = json.loads(report.read_text())
    assert data["ok"] is False and data["options"]["repeats"] == 1
    assert data["options"]["solutions"] == [f"{CANDIDATES}:raising"]
    assert len(data["problems"]) >= 3  # malformed line, unknown definition, missing blob


def test_clean_replay_exits_zero_and_writes_json(rmsnorm_dataset: Built, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "out.json"
    code, output = _cli(monkeypatch, capsys, str(rmsnorm_dataset.root), "--warmup", "0",
                        "--repeats", "1", "--solution", f"{CANDIDATES}:correct",
                        "--json", str(report))
    assert code == 0, output
    assert "ok: 4 PASS" in output and "rmsnorm_h128_bfloat16_round_twice  PASS" in output
    data = json.loads(report.read_text())
    assert data["counts"]["PASS"] == 4 and data["options"]["warmup"] == 0
    workload = data["definitions"][0]["workloads"][0]
    assert {c["check"] for c in workload["checks"]} == {"engine", "candidate"}
    name = f"{CANDIDATES}:correct"
    assert workload["candidate_ms"][name] > 0 and workload["speedup"][name] > 0
    assert data["summary"][0]["solution"] == name and data["summary"][0]["status"] == "PASS"


def test_foreign_definition_refused_then_trusted(foreign_dataset: Built,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code, output = _cli(monkeypatch, capsys, str(foreign_dataset.root), "--repeats", "0")
    assert code == 1
    assert ("REFUSED scale_d16: its reference is not from a known enginetap family; dataset "
            "code runs only with --trust-dataset-code") in " ".join(output.split())
    code, output = _cli(monkeypatch, capsys, str(foreign_dataset.root), "--repeats", "0",
                        "--trust-dataset-code", "--definition", "scale_d16")
    assert code == 0, output


def test_unusable_options_exit_two_with_one_line(rmsnorm_dataset: Built,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code, output = _cli(monkeypatch, capsys, str(rmsnorm_dataset.root), "--solution",
                        "no_such_module_here:f")
    assert code == 2 and "cannot import solution module 'no_such_module_here'" in output
    code, output = _cli(monkeypatch, capsys, str(rmsnorm_dataset.root / "missing"))
    assert code == 2 and "no dataset at" in output
    if not torch.cuda.is_available():
        code, output = _cli(monkeypatch, capsys, str(rmsnorm_dataset.root), "--device", "cuda")
        assert code == 2 and "Fix: use --device cpu" in " ".join(output.split())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_replay_times_with_events(rmsnorm_dataset: Built, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    code, output = _cli(monkeypatch, capsys, str(rmsnorm_dataset.root), "--device", "cuda",
                        "--solution", f"{CANDIDATES}:into", "--repeats", "3")
    assert code == 0, output
