"""``--device`` / ``--dtype`` on ``capture`` and ``tap run``, and ``--engine vllm`` where
vLLM does not import: each refusal is one line, exit 2, and leaves ``--out`` untouched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from enginetap.errors import ConfigError
from enginetap.jobs.device import check_device, check_dtype

NO_GPU = not torch.cuda.is_available()

# A sitecustomize that makes every ``import vllm`` fail as on a machine without it: a real
# ModuleNotFoundError from the import system, raised before any vLLM file is read.
BLOCK_VLLM = '''
import sys

class _NoVLLM:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoVLLM)
'''


def _cli(*args: str, cwd: Path, shim: Path | None = None) -> subprocess.CompletedProcess:
    path = [str(shim)] if shim else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, *sys.path]), "COLUMNS": "400"}
    return subprocess.run([sys.executable, "-m", "enginetap.cli.main", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=600)


def _one_line_refusal(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("error: ") and done.stderr.strip().count("\n") == 0, done.stderr
    for word in words:
        assert word in done.stderr, done.stderr


def _untouched(out: Path) -> None:
    assert not out.exists() or not any(out.iterdir()), sorted(out.rglob("*"))


# ------------------------------------------------------------------ the checks
def test_device_names_are_checked_before_torch_is_asked() -> None:
    assert check_device(None, "builtin") == "cpu" == check_device("cpu", "builtin")
    for bad in ("gpu", "cuda:", "cuda:x", "CPU", "mps"):
        with pytest.raises(ConfigError, match="unknown device"):
            check_device(bad, "builtin")
    with pytest.raises(ConfigError, match="does not apply to --engine vllm"):
        check_device("cpu", "vllm")
    assert check_device(None, "vllm") == "cpu"


def test_dtypes_per_engine() -> None:
    assert check_dtype(None, "builtin", "float32") == "float32"
    assert check_dtype("float16", "builtin", "float32") == "float16"
    assert check_dtype("auto", "vllm", "auto") == "auto"
    with pytest.raises(ConfigError, match="unknown dtype 'auto' for --engine builtin"):
        check_dtype("auto", "builtin", "float32")
    with pytest.raises(ConfigError, match="unknown dtype 'int8' for --engine vllm"):
        check_dtype("int8", "vllm", "auto")


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_named_in_the_check() -> None:
    for device in ("cuda", "cuda:1"):
        with pytest.raises(ConfigError, match="no CUDA GPU is visible") as info:
            check_device(device, "builtin")
        assert "--device cpu" in str(info.value)


# ------------------------------------------------------------------ the CLI
@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU")
@pytest.mark.parametrize("command", [
    ["capture", "--model", "builtin:llama"],
    ["tap", "run", "--model", "builtin:llama", "--prompts", "builtin:short"],
])
def test_cli_device_cuda_without_a_gpu_is_one_line(tmp_path: Path, command: list[str]) -> None:
    out = tmp_path / "out"
    done = _cli(*command, "--out", str(out), "--device", "cuda", cwd=tmp_path)
    _one_line_refusal(done, "--device cuda: no CUDA GPU is visible", "--device cpu")
    _untouched(out)


@pytest.mark.parametrize(("extra", "words"), [
    (["--device", "tpu"], ["unknown device 'tpu'"]),
    (["--dtype", "int4"], ["unknown dtype 'int4' for --engine builtin"]),
    (["--engine", "vllm", "--device", "cpu"], ["does not apply to --engine vllm"]),
    (["--engine", "vllm", "--dtype", "float64"], ["unknown dtype 'float64' for --engine vllm"]),
])
@pytest.mark.parametrize("command", [
    ["capture", "--model", "builtin:llama"],
    ["tap", "run", "--model", "builtin:llama", "--prompts", "builtin:short"],
])
def test_cli_bad_device_or_dtype_is_one_line(tmp_path: Path, command: list[str],
                                             extra: list[str], words: list[str]) -> None:
    out = tmp_path / "out"
    done = _cli(*command, "--out", str(out), *extra, cwd=tmp_path)
    _one_line_refusal(done, *words)
    _untouched(out)


def test_tap_run_takes_device_and_dtype(tmp_path: Path) -> None:
    done = _cli("tap", "run", "--model", "builtin:llama", "--prompts", "builtin:short",
                "--out", str(tmp_path / "run"), "--device", "cpu", "--dtype", "bfloat16",
                "--max-new-tokens", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    header = json.loads((tmp_path / "run" / "tap-rank0.jsonl").read_text().splitlines()[0])
    assert "bfloat16" in json.dumps(header), header


# -------------------------------------------------- --engine vllm without vLLM
@pytest.mark.parametrize("command", [
    ["capture", "--model", "builtin:llama"],
    ["tap", "run", "--model", "builtin:llama", "--prompts", "builtin:short"],
    ["tap", "run", "--model", "builtin:llama", "--prompts", "builtin:short",
     "--vector-steps", "1", "--vector-checkpoints", "L0"],  # no control file left either
])
def test_engine_vllm_without_vllm_is_one_line_and_retry_is_not_refused(
        tmp_path: Path, command: list[str]) -> None:
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(BLOCK_VLLM)
    out = tmp_path / "out"
    for _ in range(2):  # the retry into the same --out meets the same error, not a refusal
        done = _cli(*command, "--engine", "vllm", "--out", str(out), cwd=tmp_path, shim=shim)
        _one_line_refusal(done, "vLLM is not installed", "pip install enginetap[vllm]")
        _untouched(out)
