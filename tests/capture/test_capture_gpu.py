"""Capture from the built-in engine on a CUDA device (skipped without one).

The GPU path differs from the CPU one where it matters: copies go into the pinned ring
without waiting, and adapters check what they assume on the device (e.g. transformers'
``repeat_kv``) for the writer to read. Every decode step is selected, so every layer's
paged decode cache is gathered by the vectorised page path.
"""

from __future__ import annotations

import json

import pytest
import torch

from enginetap.config import ArmConfig
from enginetap.dataset import validate_dataset
from enginetap.engines.hf import HFEngine, Request
from enginetap.engines.hf.arming import disarm
from enginetap.replay import replay_dataset

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA device")]

EVERY_DECODE = {"name": "gpu-every-decode", "prefill": True, "decode_steps": list(range(16)),
                "per_variant": 64, "per_definition": 512, "per_layer": True}


# qwen3_next in bfloat16, the dtype such a model runs in: where flash-linear-attention is
# installed, transformers runs the gated delta rule through fla's Triton chunk kernel, whose
# float32 dot products are TF32. Its float32 captures then fail replay at the float32
# tolerance, as they should (measured on the H200: 5 of 18,688 output elements up to 1.2e-5
# off at |x| ~ 0.007, where the float32 reference is within 7.5e-8 of float64; without fla
# the float32 capture passes).
@pytest.mark.parametrize("writer", ["thread", "process"])
@pytest.mark.parametrize(("model", "dtype"), [("llama", torch.float32),
                                              ("qwen3_next", torch.bfloat16)])
def test_capture_on_cuda_keeps_tokens_and_replays(tmp_path, model: str,
                                                  dtype: torch.dtype, writer: str) -> None:
    # the process writer: the engine copies into a shared ring (a memfd registered with
    # CUDA) that the writer process maps
    # padded batch of unequal prompts: a mask, hence repeat_kv and left-padded caches
    prompts = [list(range(3, 3 + n)) for n in (23, 9, 40, 1)]
    requests = [Request(request_id=f"g{i}", prompt_ids=p, max_new_tokens=6)
                for i, p in enumerate(prompts)]
    disarmed = [c.output_ids for c in HFEngine.from_builtin(
        model, device="cuda", dtype=dtype).generate(requests)]
    config = ArmConfig(enabled=True, capabilities=["capture"], out_dir=tmp_path / "run",
                       options={"capture": {"dataset": str(tmp_path / "ds"),
                                            "policy": EVERY_DECODE, "writer": writer}})
    engine = HFEngine.from_builtin(model, device="cuda", dtype=dtype, arm=config)
    try:
        armed = [c.output_ids for c in engine.generate(requests)]
    finally:
        disarm()
    assert armed == disarmed
    summary = json.loads((tmp_path / "run" / "capture-summary-rank0.json").read_text())
    assert summary["written"] > 0 and not summary["disabled_probes"], summary
    assert summary["refused_by_dataset"] == 0
    assert validate_dataset(tmp_path / "ds") == []
    report = replay_dataset(tmp_path / "ds", progress=False)
    failed = [(d.name, w.axes, w.message, [c.model_dump(exclude_none=True) for c in w.checks
                                           if c.status != "PASS"])
              for d in report.definitions for w in d.workloads if w.status != "PASS"]
    assert report.ok, failed
