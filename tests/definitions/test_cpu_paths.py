"""The tests that compare references with vLLM CPU kernels hold on every kernel path.

vLLM CPU picks a build and kernels by the CPU's instruction sets: AMX/AVX512-BF16 machines
(Intel Sapphire Rapids and later, AMD Zen 4) run ``vllm._C``, AVX-512 machines without BF16
``vllm._C_AVX512``, AVX2-only machines (AMD EPYC before Zen 4) ``vllm._C_AVX2``; attention,
MLA and GDN choose AMX or vector kernels too. Their numerics differ (the two latter builds
convert float32 to bf16 by truncation). CI runs on whichever machine it gets, so every
vLLM comparison in tests/definitions runs here once more per other path this CPU can
execute, in a subprocess whose CPU probes (and torch's own kernels, ATEN_CPU_CAPABILITY)
report that path's features (see conftest.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.definitions.conftest import CPU_PATH_VAR

HERE = Path(__file__).parent


def _runnable() -> list[str]:
    """The paths, other than this CPU's own, whose instructions it has."""
    if not torch.cpu._is_avx512_supported():
        return []  # an AVX2 machine: its own path is the only one it can run
    return ["avx2"] + ["avx512"] * torch.cpu._is_avx512_bf16_supported()


def _run_path(path: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, CPU_PATH_VAR: path, "ATEN_CPU_CAPABILITY": path}
    return subprocess.run(
        # kernel-level comparisons only: the tests that start a vLLM engine (marked
        # `vllm`) belong to make test's other process, which holds the vLLM lock
        [sys.executable, "-m", "pytest", str(HERE), "-q", "-k", "vllm", "-m", "not vllm", "-p",
         "no:cacheprovider", "--deselect",
         f"{HERE / Path(__file__).name}::test_vllm_comparisons_hold_on_every_cpu_path"],
        env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def path_runs() -> dict[str, subprocess.CompletedProcess[str]]:
    """Every runnable path's child run, side by side (each is one single-threaded pytest)."""
    from tests.pairwise import side_by_side

    pytest.importorskip("vllm._custom_ops", reason="vLLM CPU ops are not installed")
    paths = _runnable()
    return dict(zip(paths, side_by_side([lambda p=p: _run_path(p) for p in paths])))


@pytest.mark.skipif(CPU_PATH_VAR in os.environ, reason="already emulating a CPU path")
@pytest.mark.parametrize("path", _runnable())
def test_vllm_comparisons_hold_on_every_cpu_path(path: str, path_runs) -> None:
    pytest.importorskip("vllm._custom_ops", reason="vLLM CPU ops are not installed")
    run = path_runs[path]
    tail = (run.stdout + run.stderr)[-4000:]
    assert run.returncode == 0, tail
    assert " passed" in tail and " failed" not in tail, tail
