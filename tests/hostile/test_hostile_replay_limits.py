"""Replay's limits hold for everything it runs: imports under ``--timeout``, enginetap's own
references under the same timeout and memory bound as candidates, and a workload whose
small blobs expand (pages referenced many times) past the bound refused before it runs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

import enginetap
from enginetap.dataset import Dataset
from enginetap.dataset.schema import AxisConst, AxisVar, Definition, TensorSpec
from enginetap.definitions import get_template
from enginetap.replay import replay_dataset
from enginetap.replay.synth import synthesize
from tests.replay.replay_helpers import receipt

SRC = Path(enginetap.__file__).resolve().parents[1]
ENGINETAP = Path(sys.executable).parent / "enginetap"


def _enginetap(*args: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "200"}
    return subprocess.run([str(ENGINETAP), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _foreign(root: Path, reference: str) -> Path:
    definition = Definition(
        name="scale_d16", op_type="scale", axes={"n": AxisVar(), "d": AxisConst(value=16)},
        inputs={"x": TensorSpec(shape=["n", "d"], dtype="float32"),
                "factor": TensorSpec(shape=None, dtype="float32")},
        outputs={"y": TensorSpec(shape=["n", "d"], dtype="float32")}, reference=reference)
    dataset = Dataset(root, create=True)
    x = torch.randn(2, 16)
    dataset.add_workload(definition, {"x": x, "factor": 2.0}, outputs={"y": x * 2},
                         receipt=receipt())
    return root


def test_a_trusted_reference_that_hangs_at_import_is_stopped_by_timeout(tmp_path: Path) -> None:
    ds = _foreign(tmp_path / "ds", "while True:\n    pass\n\ndef run(x, factor):\n"
                                   "    return x * factor\n")
    start = time.monotonic()
    done = _enginetap("replay", str(ds), "--trust-dataset-code", "--timeout", "3",
                      cwd=tmp_path, timeout=60)
    assert time.monotonic() - start < 60
    assert done.returncode == 1, done.stdout + done.stderr
    assert "no reply within 3 s" in done.stdout, done.stdout


def test_a_solution_that_hangs_at_import_is_stopped_by_timeout(tmp_path: Path) -> None:
    ds = _foreign(tmp_path / "ds", "def run(x, factor):\n    return x * factor\n")
    slow = tmp_path / "slow.py"
    slow.write_text("while True:\n    pass\n\ndef run(x, factor):\n    return x * factor\n")
    start = time.monotonic()
    done = _enginetap("replay", str(ds), "--trust-dataset-code", "--timeout", "3",
                      "--solution", f"{slow}:run", cwd=tmp_path, timeout=60)
    assert time.monotonic() - start < 60
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no reply within 3 s" in done.stderr and "Traceback" not in done.stderr


def test_enginetap_references_run_under_the_timeout(tmp_path: Path) -> None:
    # 200,000 rows: 20 timed runs of the reference take far more than half a second.
    dataset = Dataset(tmp_path / "ds", create=True)
    definition = get_template("rmsnorm").example_definition()
    x, w = torch.randn(200_000, 128).to(torch.bfloat16), torch.randn(128).to(torch.bfloat16)
    dataset.add_workload(definition, {"hidden_states": x, "weight": w, "eps": 1e-6},
                         receipt=receipt())
    start = time.monotonic()
    report = replay_dataset(dataset.root, warmup=0, repeats=20, timeout=0.5)
    assert time.monotonic() - start < 60
    (result,) = report.definitions
    # Loading it or calling it (in the child) takes longer than that.
    messages = [result.message or ""] + [w.message or "" for w in result.workloads]
    assert result.status == "ERROR", result
    assert any("no reply within 0.5 s" in m for m in messages), messages
    assert not report.ok


def _repeated_pages(root: Path, pages_referenced: int) -> Dataset:
    """A gqa_paged_decode workload of one page, referenced ``pages_referenced`` times."""
    dataset = Dataset(root, create=True)
    definition = get_template("gqa_paged_decode").example_definition()
    consts = definition.const_axes
    h, kv, d, ps = (consts[a] for a in ("num_qo_heads", "num_kv_heads", "head_dim", "page_size"))
    cache = torch.randn(1, ps, kv, d).to(torch.bfloat16)
    inputs = {"q": torch.randn(1, h, d).to(torch.bfloat16), "k_cache": cache,
              "v_cache": cache.clone(),
              "kv_indptr": torch.tensor([0, pages_referenced], dtype=torch.int32),
              "kv_indices": torch.zeros(pages_referenced, dtype=torch.int32),
              "kv_last_page_len": torch.tensor([ps], dtype=torch.int32), "sm_scale": 0.125}
    dataset.add_workload(definition, inputs, receipt=receipt())
    return dataset


def test_pages_referenced_many_times_are_refused_before_running(tmp_path: Path) -> None:
    # 65,536 references to one 2 KiB page: a 0.25 MiB index blob gathering 2 x 128 MiB.
    dataset = _repeated_pages(tmp_path / "ds", 1 << 16)
    report = replay_dataset(dataset.root, warmup=0, repeats=0, memory_limit=64 << 20)
    (workload,) = report.definitions[0].workloads
    assert workload.status == "ERROR", workload
    assert "pages referenced" in (workload.message or "") and "memory limit" in workload.message
    assert not report.ok


def test_code_past_the_memory_limit_is_an_error_row(tmp_path: Path) -> None:
    ds = _foreign(tmp_path / "ds", "import torch\n\ndef run(x, factor):\n"
                                   "    big = torch.ones(1 << 29)\n    return x * factor\n")
    report = replay_dataset(ds, trust_dataset_code=True, warmup=0, repeats=0,
                            memory_limit=256 << 20)
    (workload,) = report.definitions[0].workloads
    assert workload.status == "ERROR", workload
    assert "memory limit of 256 MiB" in (workload.message or ""), workload.message
