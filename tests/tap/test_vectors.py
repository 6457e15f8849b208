"""Raw rows are kept at a pair's first split (and for a step window), in safetensors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from enginetap.core.context import current_step
from enginetap.core.patching import PatchSet
from enginetap.engines.hf import HFEngine
from enginetap.tap.fingerprint import hash_rows
from enginetap.tap.pairs import find_pairs

from .conftest import Recorder, requests

SAME = ["the cache holds every key", "the cache holds every key", "decode"]


def test_rows_are_written_at_the_first_split_and_match_the_hashes(record: Recorder) -> None:
    victim: dict = {}

    def corrupt(wrapped, instance, args, kwargs):
        out = wrapped(*args, **kwargs)
        step = current_step()
        if instance is victim.get("module") and step is not None and step.step == 2:
            out = out.clone()
            row = step.rows.token_index[step.rows.rows_of_key("r1")[-1]]
            out.view(-1, out.shape[-1])[row, 3] += 1.0
        return out

    original = HFEngine.__init__

    def remember(self, *args, **kwargs):
        original(self, *args, **kwargs)
        victim["module"] = self.model.model.layers[0].mlp

    faults = PatchSet("test-fault")
    faults.add("transformers.models.llama.modeling_llama:LlamaMLP.forward", corrupt)
    with faults, pytest.MonkeyPatch.context() as mp:
        mp.setattr(HFEngine, "__init__", remember)
        _, run = record("llama", requests(SAME), vectors="split")
    folder = run.root / "tap-vectors-rank0"
    assert sorted(p.name for p in folder.iterdir()) == ["step2.safetensors"]
    step = next(s for s in run.rank(0).steps if s.step == 2)
    with safe_open(str(folder / "step2.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["reason"]) == {"pairs": [["r0", "r1"]]}
        assert set(f.keys()) == set(step.checkpoints)
        rows = f.get_tensor("L0.mlp.out")
    hashes = [f"{v & (1 << 64) - 1:016x}" for v in hash_rows(rows).tolist()]
    assert hashes == step.hashes[step.checkpoints.index("L0.mlp.out")]
    i, j = (next(n for n, r in enumerate(step.rows) if r["key"] == k) for k in ("r0", "r1"))
    assert (rows[i] != rows[j]).sum() == 1
    assert find_pairs(run.rank(0))[0].checkpoint == "L0.mlp.out"


def test_a_step_window_writes_those_steps(record: Recorder) -> None:
    _, run = record("llama", requests(SAME, max_new_tokens=4), vectors="window",
                    vector_steps=[1, 2])
    folder = run.root / "tap-vectors-rank0"
    assert sorted(p.name for p in folder.iterdir()) == ["step1.safetensors",
                                                        "step2.safetensors"]
    with safe_open(str(folder / "step1.safetensors"), "pt") as f:
        assert f.get_tensor("L1.out").dtype == torch.float32
