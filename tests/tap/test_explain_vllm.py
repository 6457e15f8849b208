"""``enginetap tap explain`` on vLLM CPU: a planted batch-position-dependent norm is named
batch-variant, and REPRO replays showing the same difference (``vllm_explain_run.py``: two
engine starts, the recording and the re-run)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from enginetap.dataset import Dataset
from enginetap.replay.runner import replay_dataset

HERE = Path(__file__).parent
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_a_batch_position_dependent_norm_on_vllm_is_batch_variant(
        vllm_lock: None, tmp_path: Path) -> None:
    sys.path.insert(0, str(HERE.parent / "engines" / "vllm"))
    from vllm_harness import child_env, run_script

    script = str(HERE / "vllm_explain_run.py")
    run_script([script, "record", str(tmp_path)], child_env(), tmp_path / "record.log")
    text = run_script([script, "explain", str(tmp_path)], child_env(), tmp_path / "explain.log")
    result = json.loads(text[text.index("{\n"):text.rindex("}") + 1])
    assert result["kind"] == "batch-variant", result
    assert "RMSNorm.forward" in result["verdict"] and "in L0.in_norm" in result["verdict"]
    assert result["finding"].startswith("pair p0/p1 at step 0"), result
    assert "the re-run split again at step 0 L0.in_norm.out" in result["evidence"]
    # REPRO's bytes: the copies batch holds p0's alone output at position 0 and other
    # bytes at positions 1 and 2 (the plant adds its row's offset there)
    dataset = Dataset(tmp_path / "repro")
    lines = {}
    for name in dataset.definitions():
        for line in dataset.workloads(name):
            assert line.enginetap is not None
            notes = line.enginetap.receipt.notes
            lines.setdefault((notes["config"], notes["side"]), line)
    alone = dataset.load_outputs(lines[("alone", "p0")])["output"]
    copies = dataset.load_outputs(lines[("copies", "p0")])["output"]
    n = alone.shape[0]
    assert torch.equal(copies[:n], alone) and not torch.equal(copies[n:2 * n], alone)
    # and the replay against the reference sees the same: copies farther off than alone
    errors = {w.uuid: max(c.comparison.max_abs_error or 0.0 for c in w.checks
                          if c.check == "engine" and c.comparison is not None)
              for d in replay_dataset(tmp_path / "repro", repeats=1, warmup=0).definitions
              for w in d.workloads}
    assert errors[lines[("copies", "p0")].workload.uuid] > \
        errors[lines[("alone", "p0")].workload.uuid]
