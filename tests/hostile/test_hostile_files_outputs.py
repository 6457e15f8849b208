"""`tap run --out EXISTING` and `capture --out EXISTING_DATASET` (a new user's trial).

A second tap run into the same directory silently replaced the first; a second capture
into a dataset silently appended the same workloads again and overwrote the first run's
``capture-run.json``. Now both refuse (exit 2, one line saying what would happen) unless
asked: ``tap run --force`` replaces the previous run's tap files (nothing else in the
directory); ``capture --append`` adds this run's workloads and keeps the previous run's
records under ``enginetap/previous/run-<n>/``; ``capture --force`` starts the dataset
afresh (its definitions, workloads, blobs and run records; nothing else).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


import enginetap
from enginetap.dataset import Dataset

SRC = Path(enginetap.__file__).resolve().parents[1]
PROFILE = {"name": "one", "source": "test", "requests": [
    {"label": "a", "input_tokens": 12, "output_tokens": 2, "hash_ids": [1], "block_size": 16}]}


def _enginetap(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "300", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "enginetap.cli.main", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=600)


def _refused(done: subprocess.CompletedProcess[str], *words: str) -> None:
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), done.stderr
    for word in words:
        assert word in lines[0], lines[0]


def _tap(cwd: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return _enginetap("tap", "run", "--model", "builtin:llama", "--prompts", "builtin:short",
                      "--out", "run", "--max-new-tokens", "2", *extra, cwd=cwd)


def test_tap_run_never_silently_replaces_a_run(tmp_path: Path) -> None:
    first = _tap(tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    tap_file = tmp_path / "run" / "tap-rank0.jsonl"
    with tap_file.open("a") as f:
        f.write('{"marker": "the first run"}\n')
    (tmp_path / "run" / "notes.txt").write_text("mine")
    before = tap_file.read_bytes()
    _refused(_tap(tmp_path), "run", "tap-rank0.jsonl", "--force")
    assert tap_file.read_bytes() == before
    forced = _tap(tmp_path, "--force")
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert b"the first run" not in tap_file.read_bytes() and tap_file.stat().st_size > 0
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"


def _capture(cwd: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return _enginetap("capture", "--model", "builtin:llama", "--profile", "one.json",
                      "--out", "ds", "--max-output-tokens", "2", *extra, cwd=cwd)


def _count(root: Path) -> int:
    dataset = Dataset(root)
    return sum(len(dataset.workloads(name)) for name in dataset.definitions())


def test_capture_into_a_dataset_needs_append_or_force(tmp_path: Path) -> None:
    (tmp_path / "one.json").write_text(json.dumps(PROFILE))
    first = _capture(tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    ds = tmp_path / "ds"
    run = ds / "enginetap" / "capture-run.json"
    first_run, workloads = run.read_bytes(), _count(ds)
    assert workloads > 0
    _refused(_capture(tmp_path), "--append", "--force")
    assert run.read_bytes() == first_run and _count(ds) == workloads
    _refused(_capture(tmp_path, "--append", "--force"), "--append", "--force")
    assert run.read_bytes() == first_run

    appended = _capture(tmp_path, "--append")
    assert appended.returncode == 0, appended.stderr[-3000:]
    assert _count(ds) == 2 * workloads
    kept = ds / "enginetap" / "previous" / "run-1" / "capture-run.json"
    assert kept.read_bytes() == first_run
    assert json.loads(run.read_text())["status"] == "complete" and run.read_bytes() != first_run

    (ds / "README.md").write_text("my notes on this dataset")
    forced = _capture(tmp_path, "--force")
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert _count(ds) == workloads
    assert not (ds / "enginetap" / "previous").exists()
    assert (ds / "README.md").read_text() == "my notes on this dataset"
