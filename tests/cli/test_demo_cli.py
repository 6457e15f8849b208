"""`enginetap demo` end to end: engine steps, a dataset that validates, a clean replay."""

from __future__ import annotations

import os
import subprocess
import sys

from enginetap.dataset import Dataset, validate_dataset


def _demo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "enginetap.cli.main", "demo", *args],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "200"})


def test_demo_runs_engine_writes_validates_and_replays(tmp_path):
    out = tmp_path / "[exp1]" / "demo"  # markup-like path: printed as is
    result = _demo("--out", str(out), "--workloads", "1", "--max-new-tokens", "3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert f"3. dataset {out / 'dataset'}" in result.stdout
    assert "5. replay ok" in result.stdout and "req-prefix" in result.stdout
    names = set(Dataset(out / "dataset").definitions())
    assert {"rmsnorm_h128_bfloat16_round_twice", "gqa_paged_decode_h4_kv2_d32_ps16_bfloat16"} <= names
    assert any(n.startswith("moe_grouped_gemm_fp8_fp4") for n in names)
    assert validate_dataset(out / "dataset") == []
    # A second run replaces only its own earlier output: a file the user put beside it stays.
    (out / "notes.txt").write_text("mine")
    again = _demo("--out", str(out), "--workloads", "1", "--max-new-tokens", "2")
    assert again.returncode == 0, again.stdout + again.stderr
    assert (out / "notes.txt").read_text() == "mine"
    assert validate_dataset(out / "dataset") == []


def test_demo_refuses_a_directory_it_did_not_make(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    result = _demo("--out", str(tmp_path))
    assert result.returncode == 2 and "not made by `enginetap demo`" in result.stderr
    assert (tmp_path / "precious.txt").read_text() == "keep me"
