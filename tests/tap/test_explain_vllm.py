"""``enginetap tap explain`` on vLLM CPU: a planted batch-position-dependent norm is named
batch-variant, and REPRO replays showing the same difference (``vllm_explain_run.py``: two
engine starts, the recording and the re-run)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

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
    dataset = Dataset(tmp_path / "repro")
    status = {w.uuid: w.status for d in replay_dataset(tmp_path / "repro", repeats=1,
                                                       warmup=0).definitions
              for w in d.workloads}
    by_config: dict[str, set[str]] = {}
    for name in dataset.definitions():
        for line in dataset.workloads(name):
            assert line.enginetap is not None
            by_config.setdefault(line.enginetap.receipt.notes["config"], set()).add(
                status[line.workload.uuid])
    assert by_config["alone"] == {"PASS"} and by_config["copies"] == {"FAIL"}
