"""`tap diff` never says "no divergence" (exit 0) when it compared nothing, and never
compares runs of different models without a word."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .tap_helpers import enginetap, one_error_line, record_tap, tap_lines, write_tap


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import torch

    root = tmp_path_factory.mktemp("tap-diff")
    made = {"llama": record_tap(root / "llama"), "qwen3": record_tap(root / "qwen3", "qwen3")}
    from enginetap.jobs.tap import record_run

    record_run("builtin:llama", ["the cache holds every key", "kernels and caches"],
               root / "bf16", max_new_tokens=3, dtype="bfloat16")
    made["bf16"] = root / "bf16"
    assert torch.get_default_dtype() == torch.float32
    return made


def _rewritten(run: Path, out: Path, change: Any) -> Path:
    records = tap_lines(run)
    for record in records[1:]:
        change(record)
    write_tap(out, records)
    return out


def _other_keys(record: dict[str, Any]) -> None:
    for row in record["rows"]:
        row["key"] = row["request_id"] = "q" + row["key"]
    record["sampled"] = {"q" + k: v for k, v in record.get("sampled", {}).items()}


def _other_checkpoints(record: dict[str, Any]) -> None:
    record["checkpoints"] = ["other." + name for name in record["checkpoints"]]


@pytest.mark.parametrize("change,why", [(_other_keys, "no request key"),
                                        (_other_checkpoints, "no checkpoint name")],
                         ids=["keys", "checkpoints"])
def test_runs_that_share_nothing_are_not_a_clean_diff(runs: dict[str, Path], tmp_path: Path,
                                                      change: Any, why: str) -> None:
    other = _rewritten(runs["llama"], tmp_path / "other", change)
    for args in ([str(runs["llama"]), str(other)], [str(other), str(runs["llama"]), "--json"]):
        line = one_error_line(enginetap("tap", "diff", *args), "error: ", "nothing compared")
        assert why in line, line


def test_a_run_against_itself_still_compares_everything(runs: dict[str, Path]) -> None:
    done = enginetap("tap", "diff", str(runs["llama"]), str(runs["llama"]), "--json")
    assert done.returncode == 0, done.stderr
    (result,) = json.loads(done.stdout)
    assert result["rows_compared"] > 0 and result["checkpoints_compared"] > 10


def test_runs_of_different_models_are_refused(runs: dict[str, Path]) -> None:
    line = one_error_line(enginetap("tap", "diff", str(runs["llama"]), str(runs["qwen3"])),
                          "error: ", "different models")
    assert "llama" in line and "qwen3" in line


def test_runs_of_different_dtypes_are_flagged(runs: dict[str, Path]) -> None:
    done = enginetap("tap", "diff", str(runs["llama"]), str(runs["bf16"]))
    assert done.returncode in (0, 1) and "Traceback" not in done.stderr, done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, done.stderr
    assert "float32" in warnings[0] and "bfloat16" in warnings[0]
