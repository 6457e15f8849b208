"""``enginetap capture`` and ``enginetap tap run`` on a CUDA device from the command line
(skipped without one): the dataset replays, the tap run reports, and the files say cuda."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA device")]


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "COLUMNS": "400"}
    return subprocess.run([sys.executable, "-m", "enginetap.cli.main", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=900)


def test_capture_on_cuda_from_the_cli_replays(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    done = _cli("capture", "--model", "builtin:llama", "--out", str(ds), "--device", "cuda",
                "--dtype", "float32", "--max-output-tokens", "8", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = json.loads((ds / "enginetap" / "capture-run.json").read_text())
    assert run["status"] == "complete" and run["device"] == "cuda" and run["dtype"] == "float32"
    workloads = [line for path in (ds / "workloads").rglob("*.jsonl")
                 for line in path.read_text().splitlines()]
    assert workloads
    replayed = _cli("replay", str(ds), cwd=tmp_path)
    assert replayed.returncode == 0, replayed.stdout[-3000:] + replayed.stderr[-3000:]


def test_tap_run_on_cuda_from_the_cli_reports(tmp_path: Path) -> None:
    run = tmp_path / "run"
    done = _cli("tap", "run", "--model", "builtin:qwen3_moe", "--prompts", "builtin:pairs",
                "--out", str(run), "--device", "cuda:0", "--dtype", "bfloat16",
                "--max-new-tokens", "4", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = (run / "tap-rank0.jsonl").read_text().splitlines()
    header, records = json.loads(lines[0]), [json.loads(line) for line in lines[1:]]
    assert header["models"][0]["dtype"] == "torch.bfloat16", header
    assert records, "no step was recorded"
    report = _cli("tap", "report", str(run), "--html", str(tmp_path / "run.html"), cwd=tmp_path)
    assert report.returncode == 0, report.stdout[-3000:] + report.stderr[-3000:]
    assert (tmp_path / "run.html").read_text(encoding="utf-8").lower().startswith("<!doctype html>")
