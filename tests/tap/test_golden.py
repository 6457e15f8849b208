"""Golden tap records: a fixed built-in-engine run (tiny random-weight models, float32 on
the CPU, default tap options) writes exactly these bytes. Any change to the recorder, the
checkpoint names or order, the hash or the record format shows here first; a deliberate
format change updates the values below and says why in its commit.

The values hold on an x86-64 CPU with this project's pinned torch; another CPU may round
float32 kernels differently (the test then fails on the tokens or the first step). One CPU
thread (more split a batch's rows differently: identical rows then differ in their bits)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from golden_run import golden_digest  # noqa: E402

LLAMA: dict[str, Any] = {
    "tokens": [[40, 245, 501, 75, 176, 184, 501], [372, 206, 125, 184, 196, 459, 206],
               [40, 245, 501, 75, 176, 184, 501], [349, 254, 254, 254, 254, 507, 464]],
    "models": [{"class": "LlamaForCausalLM", "dtype": "torch.float32",
                "model_type": "llama", "layers": 2}],
    "steps": ["d25337f107e59f09", "a23891ac42ce3cce", "892e53ab93cb8f27", "db2800b422470fd5",
              "3a5a66817e36b15e", "25010d9a60e153ea", "fe107a028df06c1d"],
    "checkpoints": 17, "L0.in": "42e493c5059b0000", "L0.out": "00d6eccb41e4b4a7",
    "norm.out": "2e6197adc4c13fc8", "L0.attn.kv_written": "b3ba3b86f7815d92",
    "sampler": {"argmax": 245, "runner_up": 333, "top1": 0.5758214592933655,
                "top2": 0.4575866162776947, "gap": 0.11823484301567078},
}
QWEN3_NEXT: dict[str, Any] = {
    "tokens": [[287, 123, 467, 411, 296, 160, 330], [302, 159, 456, 352, 216, 359, 4],
               [287, 123, 467, 411, 296, 160, 330], [470, 175, 207, 185, 178, 216, 348]],
    "models": [{"class": "Qwen3NextForCausalLM", "dtype": "torch.float32",
                "model_type": "qwen3_next", "layers": 4}],
    "steps": ["4b6a35e29510a352", "585dc72d9a2617bc", "2aa911946a142133", "d27645258985dbdc",
              "4dfad5a9d6372d03", "a29934ae07f45502", "d0a78359d2d0bc6b"],
    "checkpoints": 61, "L0.in": "b9bda6a01b2f0000", "L0.out": "35f096173839dddb",
    "norm.out": "7b2d99f0418d88b1", "L0.attn.kv_written": "42a3dd84dcd49149",
    "sampler": {"argmax": 123, "runner_up": 276, "top1": 0.6561570167541504,
                "top2": 0.6348456144332886, "gap": 0.021311402320861816},
}
HEADER = {"kind": "header", "format": "enginetap-tap", "version": 2, "engine": "transformers",
          "world_size": 1, "tp_size": 1, "kv_block_size": None, "cache_groups": None,
          "compiled": False, "cuda_graphs": False, "eager": True}


def assert_golden(found: dict[str, Any], expected: dict[str, Any], path: str) -> None:
    """Every pinned value equal, else one message naming each one that differs."""
    want = {**expected, "header": {**HEADER, "models": expected["models"]}}
    want.pop("models")
    differ = [f"{key}: expected {want[key]!r}, got {found.get(key)!r}"
              for key in want if found.get(key) != want[key]]
    steps = [i for i, (a, b) in enumerate(zip(found["steps"], want["steps"])) if a != b]
    if steps:
        differ.insert(0, f"step records {steps} (0 = the prefill) are not byte-identical")
    assert not differ, f"tap records of {path} differ from the golden run:\n  " + \
        "\n  ".join(differ)


@pytest.mark.parametrize(("model", "expected"), [("llama", LLAMA), ("qwen3_next", QWEN3_NEXT)])
def test_a_fixed_run_writes_the_golden_records(tmp_path: Path, model: str,
                                               expected: dict[str, Any]) -> None:
    assert_golden(golden_digest(model, tmp_path / "run"), expected, f"{model} (gathered)")


def deferred_run(out: Path, *extra: str) -> dict[str, Any]:
    """The llama golden run in a child where Triton's interpreter runs the deferred hash
    kernel on the CPU (checkpoints hashed in place at step end, quick steps)."""
    pytest.importorskip("triton", reason="Triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("golden_run.py")),
                           "llama", str(out), *extra], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_deferred_path_writes_the_same_golden_records(tmp_path: Path) -> None:
    found = deferred_run(tmp_path / "run")
    assert_golden(found, LLAMA, "llama (deferred, Triton interpreter)")
    # decode steps 1-2 verify, 3 settles the kind: 4-6 run quick, 5-6 as planned
    assert found["ran"] == {"quick": 3, "planned": 2, "at_call": []}


def test_a_prefill_past_the_byte_budget_leaves_decode_steps_quick(tmp_path: Path) -> None:
    # 40 kB: the prefill's checkpoints overflow it (gathered), a decode step's fit. The
    # prefill's gathers must not mark their names "examined at the call" for good.
    found = deferred_run(tmp_path / "run", "40000")
    assert_golden(found, LLAMA, "llama (deferred, prefill over the byte budget)")
    assert found["ran"] == {"quick": 3, "planned": 2, "at_call": []}
