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


def test_demo_captures_under_mooncake_traffic_and_replays(tmp_path):
    out = tmp_path / "[exp1]" / "demo"  # markup-like path: printed as is
    result = _demo("--out", str(out), "--models", "llama,deepseek_v3",
                   "--max-output-tokens", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert "captured llama under builtin:mooncake-tiny" in result.stdout
    assert "demo ok" in result.stdout
    llama = set(Dataset(out / "dataset" / "llama").definitions())
    assert {"rmsnorm_h128_bfloat16_round_twice", "gqa_paged_decode_h4_kv2_d32_ps16_bfloat16",
            "gqa_ragged_prefill_causal_h4_kv2_d32_bfloat16"} <= llama
    # the built-in engine never produces MLA's latent output: inputs only, said so
    mla = [line for line in result.stdout.splitlines() if line.startswith("│ mla_paged_decode")]
    assert any("INPUTS ONLY" in line for line in mla)
    for model in ("llama", "deepseek_v3"):
        assert validate_dataset(out / "dataset" / model) == []
        receipts = [l.enginetap.receipt for n in Dataset(out / "dataset" / model).definitions()
                    for l in Dataset(out / "dataset" / model).workloads(n)]
        assert receipts and all(r.source.startswith("capture:") for r in receipts)
    # A second run replaces only its own earlier output: a file the user put beside it stays.
    (out / "notes.txt").write_text("mine")
    again = _demo("--out", str(out), "--models", "llama", "--max-output-tokens", "2")
    assert again.returncode == 0, again.stdout + again.stderr
    assert (out / "notes.txt").read_text() == "mine"
    assert not (out / "dataset" / "deepseek_v3").exists()
    assert validate_dataset(out / "dataset" / "llama") == []


def test_demo_refuses_a_directory_it_did_not_make(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    result = _demo("--out", str(tmp_path))
    assert result.returncode == 2 and "not made by `enginetap demo`" in result.stderr
    assert (tmp_path / "precious.txt").read_text() == "keep me"
