"""``enginetap tap explain`` on vLLM CPU, one planted cause per test (``vllm_explain_run.py``:
two engine starts each, the recording and the re-run): a batch-position-dependent norm is
named batch-variant, a norm adding fresh noise nondeterministic, a gated-delta layer reading
another request's recurrent state slot upstream with the slot named; REPRO replays showing
the same difference."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from enginetap.dataset import Dataset
from enginetap.replay.runner import replay_dataset
from enginetap.tap.diff import diff_runs
from enginetap.tap.files import load_run

HERE = Path(__file__).parent
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def explain_case(case: str, out: Path) -> dict[str, Any]:
    """Record the case's planted run, explain pair p0/p1 of it; the command's JSON result."""
    sys.path.insert(0, str(HERE.parent / "engines" / "vllm"))
    from vllm_harness import child_env, run_script

    script = str(HERE / "vllm_explain_run.py")
    run_script([script, "record", str(out), case], child_env(), out / "record.log")
    text = run_script([script, "explain", str(out), case], child_env(), out / "explain.log")
    return json.loads(text[text.index("{\n"):text.rindex("}") + 1])


def repro_lines(repro: Path) -> dict[tuple[str, str], Any]:
    """REPRO's first workload line of each (configuration, side) its receipts name."""
    dataset = Dataset(repro)
    lines: dict[tuple[str, str], Any] = {}
    for name in dataset.definitions():
        for line in dataset.workloads(name):
            assert line.enginetap is not None
            notes = line.enginetap.receipt.notes
            lines.setdefault((notes["config"], notes["side"]), line)
    return lines


def engine_checks(repro: Path) -> dict[str, Any]:
    """uuid → the replay of the engine's stored outputs against the reference."""
    return {w.uuid: w for d in replay_dataset(repro, repeats=1, warmup=0).definitions
            for w in d.workloads}


def engine_error(workload: Any) -> float:
    return max(c.comparison.max_abs_error or 0.0 for c in workload.checks
               if c.check == "engine" and c.comparison is not None)


def test_a_batch_position_dependent_norm_on_vllm_is_batch_variant(
        vllm_lock: None, tmp_path: Path) -> None:
    result = explain_case("batch", tmp_path)
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


def test_run_to_run_noise_in_a_norm_on_vllm_is_nondeterministic(
        vllm_lock: None, tmp_path: Path) -> None:
    result = explain_case("noise", tmp_path)
    assert result["kind"] == "nondeterministic", result
    assert "RMSNorm.forward" in result["verdict"] and "in L0.in_norm" in result["verdict"]
    assert result["finding"].startswith("pair p0/p1 at step 0"), result
    # REPRO's bytes: p0 alone, twice, on the same input gives two outputs
    dataset = Dataset(tmp_path / "repro")
    lines = repro_lines(tmp_path / "repro")
    first, again = lines[("alone", "p0")], lines[("alone again", "p0")]
    assert torch.equal(dataset.load_inputs(first)["hidden_states"],
                       dataset.load_inputs(again)["hidden_states"])
    assert not torch.equal(dataset.load_outputs(first)["output"],
                           dataset.load_outputs(again)["output"])
    # and the replay against the reference sees two errors for one input
    checks = engine_checks(tmp_path / "repro")
    assert engine_error(checks[first.workload.uuid]) != engine_error(checks[again.workload.uuid])


def recorded_state_slots(run: Path, step: int) -> dict[str, int]:
    """Each request's recurrent state slot at ``step``, as the tap file's rows say."""
    lines = (run / "tap-rank0.jsonl").read_text().splitlines()
    record = next(r for line in lines[1:] if (r := json.loads(line)).get("step") == step)
    return {row["key"]: row["state_slot"] for row in record["rows"]}


def test_a_state_read_from_another_requests_slot_on_vllm_is_upstream(
        vllm_lock: None, tmp_path: Path) -> None:
    result = explain_case("slot", tmp_path)
    assert result["kind"] == "upstream", result
    assert "gdn_decode" in result["op"] and result["op"].endswith("in L0.gdn"), result
    assert "fused_sigmoid_gating_delta_rule_update_cpu" in result["op"], result
    assert result["finding"].startswith("pair p0/p1 at step 2"), result
    assert "first differing input `state`" in result["verdict"], result["verdict"]
    found = re.search(r"p1's `state` is p2's \(slot (\d+), not its own slot (\d+)\)$",
                      result["verdict"])
    assert found, result["verdict"]
    # the slots named are the ones vLLM gave p2 and p1 at that step (the tap's rows)
    slots = recorded_state_slots(tmp_path / "run", 2)
    assert (int(found[1]), int(found[2])) == (slots["p2"], slots["p1"]), slots
    # catching the calls (the model's sublayers wrapped too) changed nothing: the re-run's
    # tap equals the run's, row for row
    (same,) = diff_runs(load_run(tmp_path / "run"), load_run(tmp_path / "repro/enginetap/rerun-a"))
    assert same.rows_compared > 0 and not same.diverged
    # REPRO's bytes: the recorded call's state holds p2's state in p1's row
    dataset = Dataset(tmp_path / "repro")
    lines = repro_lines(tmp_path / "repro")
    recorded = lines[("recorded", "p0")]
    assert recorded.enginetap is not None and recorded.enginetap.receipt.engine == "vllm"
    state = dataset.load_inputs(recorded)["state"]
    assert torch.equal(state[1], state[2]) and not torch.equal(state[0], state[1])
    # called again, p1 alone reads the state it was given (p2's), p0 alone its own
    assert torch.equal(dataset.load_inputs(lines[("alone", "p1")])["state"][0], state[2])
    assert torch.equal(dataset.load_inputs(lines[("alone", "p0")])["state"][0], state[0])
    # the kernel itself is right on what it was given: its bug is upstream
    assert {w.status for w in engine_checks(tmp_path / "repro").values()} == {"PASS"}
