"""The tap arms inside vLLM CPU through the same capability (``ENGINETAP_CAPABILITIES=tap``).

One offline run of the tiny Llama (chunked prefill, a request arriving mid-way, a
repeated prompt): the worker writes a tap file whose checkpoints carry vLLM's sublayers
under the same short names as the built-in engine's, and the analyses read it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from enginetap.tap.continuity import check_continuity
from enginetap.tap.diff import diff_runs
from enginetap.tap.files import load_run
from enginetap.tap.report import analyse, summary

VLLM_TESTS = Path(__file__).parents[1] / "engines" / "vllm"

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_tap_records_inside_a_vllm_worker(vllm_lock: None, tmp_path: Path) -> None:
    sys.path.insert(0, str(VLLM_TESTS))
    from vllm_harness import OFFLINE, child_env, run_script

    from enginetap.models import build_model

    env = child_env({"ENGINETAP": "1", "ENGINETAP_CAPABILITIES": "tap",
                     "ENGINETAP_OUT": str(tmp_path / "tap")})
    log = run_script([str(OFFLINE), str(build_model("llama")), str(tmp_path / "report.json")],
                     env, tmp_path / "run.log")
    assert "tap (up to 64 rows per step" in log
    report = json.loads((tmp_path / "report.json").read_text())
    run = load_run(tmp_path / "tap")
    rank = run.rank(0)
    assert run.header["world_size"] == 1 and rank.steps
    names = rank.steps[0].checkpoints
    # the kernel layer inside self_attn is named apart from it (no "#2" duplicates)
    assert {"L0.in", "L0.attn.core.out", "L0.attn.out", "L0.mlp.out", "L1.out"} <= set(names)
    assert not [n for n in names if "#" in n]
    assert names.index("L0.in") < names.index("L0.attn.core.out") < names.index("L0.attn.out") \
        < names.index("L1.in")
    keys = {row["key"] for step in rank.steps for row in step.rows}
    assert set(report["requests"]) <= keys
    assert {s.mode for s in rank.steps} == {"prefill", "decode", "mixed"}
    assert check_continuity(rank) == []
    (self_diff,) = diff_runs(run, run)
    assert self_diff.rows_compared > 0 and not self_diff.diverged
    assert summary(analyse(run))[1].startswith("rank 0:")
