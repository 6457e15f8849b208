"""Raw rows are kept at a pair's first split (and for a step window), in safetensors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from enginetap.core.context import current_step
from enginetap.core.patching import PatchSet
from enginetap.engines.hf import HFEngine
from enginetap.tap.record.fingerprint import hash_rows
from enginetap.tap.analysis.pairs import find_pairs

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


def test_a_control_file_edited_mid_run_moves_the_dumps(record: Recorder, tmp_path,
                                                      caplog) -> None:
    control = tmp_path / "vectors.json"
    control.write_text(json.dumps({"steps": [0, 0]}))
    original = HFEngine._advance

    def edit_between_steps(self, seqs, logits, cache, mask):
        result = original(self, seqs, logits, cache, mask)
        if self.steps == 1:  # inside step 1: from now on steps 3-4, one layer, one request
            control.write_text(json.dumps({"steps": [3, 4], "checkpoints": ["L1.out", "L0.mlp"],
                                           "requests": ["r1"]}))
        elif self.steps == 4:
            control.write_text("{not json")
        return result

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(HFEngine, "_advance", edit_between_steps)
        _, run = record("llama", requests(SAME, max_new_tokens=6), vectors="control",
                        vector_control=str(control))
    folder = run.root / "tap-vectors-rank0"
    # step 0 by the first content; 1 and 2 outside the new window; 3 by the new one; 4
    # and 5 after the file became invalid (logged, nothing written)
    assert sorted(p.name for p in folder.iterdir()) == ["step0.safetensors", "step3.safetensors"]
    step0 = next(s for s in run.rank(0).steps if s.step == 0)
    with safe_open(str(folder / "step0.safetensors"), "pt") as f:
        assert set(f.keys()) == set(step0.checkpoints)
        assert len(json.loads(f.metadata()["rows"])) == len(step0.rows)
    with safe_open(str(folder / "step3.safetensors"), "pt") as f:
        assert set(f.keys()) == {"L1.out", "L0.mlp.out"}
        assert [key for key, _ in json.loads(f.metadata()["rows"])] == ["r1"]
        assert f.get_tensor("L1.out").shape[0] == 1
    assert "vector control file" in caplog.text and "is not valid" in caplog.text


def test_control_options_are_checked_when_the_config_is_parsed() -> None:
    from pydantic import ValidationError

    from enginetap.tap.options import TapOptions

    with pytest.raises(ValidationError, match="vector_control"):
        TapOptions(vectors="control")
    with pytest.raises(ValidationError, match="vector_steps"):
        TapOptions(vectors="window")
