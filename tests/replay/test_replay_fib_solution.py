"""flashinfer-bench Solution files, checked with flashinfer-bench's own schema both ways."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from enginetap.cli.main import main
from enginetap.dataset import Dataset
from enginetap.definitions.registry import get_template
from enginetap.replay import replay_dataset
from enginetap.replay.synth import synthesize
from tests.replay.replay_helpers import Built

fib = pytest.importorskip("flashinfer_bench.data")


def _cli(monkeypatch: pytest.MonkeyPatch, *args: str) -> int | str | None:
    monkeypatch.setattr(sys, "argv", ["enginetap", "replay", *args])
    with pytest.raises(SystemExit) as exited:
        main()
    return exited.value.code


def test_builtin_written_as_solution_validates_and_replays(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    dataset = Dataset(tmp_path / "ds", create=True)
    synthesize(dataset, get_template("gqa_ragged_prefill"), workloads=2, seed=2)
    synthesize(dataset, get_template("rmsnorm"), workloads=1, seed=2)
    out = tmp_path / "fib"
    assert _cli(monkeypatch, str(dataset.root), "--solution", "torch:sdpa",
                "--write-solutions", str(out)) == 0
    (path,) = sorted((out / "solutions").rglob("*.json"))  # rmsnorm is not covered
    solution = fib.Solution.model_validate_json(path.read_text())  # flashinfer-bench's schema
    assert solution.definition == "gqa_ragged_prefill_causal_h4_kv2_d32_bfloat16"
    assert solution.spec.entry_point == "main.py::run"
    assert not solution.spec.destination_passing_style
    report = replay_dataset(dataset.root, solution=str(path), warmup=0, repeats=1)
    rows = {r.definition: r for r in report.summary}
    assert rows[solution.definition].status == "PASS"
    assert rows[solution.definition].counts == {"PASS": 2}
    other = rows["rmsnorm_h128_bfloat16_round_twice"]
    assert other.status == "SKIPPED" and solution.name in other.reason


_DPS_SOURCE = '''import torch


def kernel(hidden_states, weight, eps, out):
    x = hidden_states.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    out.copy_((y.to(hidden_states.dtype).float() * weight.float()).to(out.dtype))
'''


def test_solution_made_by_flashinfer_bench_replays_in_destination_style(
        rmsnorm_dataset: Built, tmp_path: Path) -> None:
    """Its outputs are the last positional arguments, whatever the function names them."""
    solution = fib.Solution(
        name="rmsnorm_py", definition=rmsnorm_dataset.definition.name, author="tests",
        spec=fib.BuildSpec(language="python", target_hardware=["cpu"],
                           entry_point="pkg/impl.py::kernel", destination_passing_style=True),
        sources=[fib.SourceFile(path="pkg/impl.py", content=_DPS_SOURCE)])
    path = tmp_path / "rmsnorm_py.json"
    path.write_text(solution.model_dump_json())
    report = replay_dataset(rmsnorm_dataset.root, solution=str(path), warmup=0, repeats=1)
    assert report.ok, report.model_dump_json(indent=1)
    (row,) = report.summary
    assert row.status == "PASS" and row.counts == {"PASS": 2}


def test_cuda_solution_is_skipped_and_bad_files_refused(rmsnorm_dataset: Built,
                                                        tmp_path: Path) -> None:
    solution = fib.Solution(
        name="rmsnorm_cu", definition=rmsnorm_dataset.definition.name, author="tests",
        spec=fib.BuildSpec(language="cuda", target_hardware=["cuda"],
                           entry_point="k.cu::run"),
        sources=[fib.SourceFile(path="k.cu", content="// kernel")])
    path = tmp_path / "cu.json"
    path.write_text(solution.model_dump_json())
    report = replay_dataset(rmsnorm_dataset.root, solution=str(path), warmup=0, repeats=1)
    (row,) = report.summary
    assert row.status == "SKIPPED" and "needs flashinfer-bench's builder" in row.reason
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x"}))
    from enginetap.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot read the solution file"):
        replay_dataset(rmsnorm_dataset.root, solution=str(bad))
