"""The built-in engine's KV points where a decode step's every row is tapped on a device
that defers: each point is the cache column as it lies, hashed in place at step end by the
step's table kernel (no torch op per layer). An overwritten KV row is still named: in a
verification step by the verification (the record keeps the bytes at the layer's call,
and the continuity check names the row at its next reader, as on the gather path); in a
settled step by a diff against a clean run, at the step it happened, the layer's own
output agreeing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from enginetap.tap.analysis.continuity import check_continuity
from enginetap.tap.analysis.files import load_run
from enginetap.tap.record.deferred import DeferredHashes

from .conftest import named_first

pytest.importorskip("triton", reason="Triton is not installed")


def faulted_runs(out: Path, at: int, new_tokens: int, layer: int = 0) -> dict[str, Any]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # the deferred path on the CPU
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("kv_fault_run.py")),
                           str(out), str(at), str(new_tokens), str(layer)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_overwritten_kv_row_in_a_verification_step_is_named_by_continuity(
        tmp_path: Path) -> None:
    found = faulted_runs(tmp_path, at=1, new_tokens=5)
    assert found["clean"]["demoted"] == []
    # step 1 verifies its KV points: the bytes at step end differ from those at the call
    assert found["faulted"]["demoted"] == ["L0.attn.kv_written"]
    faulted = load_run(tmp_path / "faulted").rank(0)
    violations = [v for v in check_continuity(faulted) if v.kind == "kv"]
    assert violations, "the overwrite was not seen"
    step1 = next(s for s in faulted.steps if s.step == 1)
    r0 = next(r for r in step1.rows if r["key"] == "r0")
    first = violations[0]
    assert (first.step, first.checkpoint, first.key, first.position, first.slot) == (
        2, "L0.attn.kv_written", "r0", r0["pos"], r0["kv_slot"])
    assert {(v.key, v.checkpoint) for v in violations} == {("r0", "L0.attn.kv_written")}
    assert check_continuity(load_run(tmp_path / "clean").rank(0)) == []


def test_an_overwritten_kv_row_in_a_quick_step_is_named_by_a_diff(tmp_path: Path) -> None:
    # decode steps 1-2 verify, 3 settles the kind, 4-6 run quick (the KV points kept at
    # their call): the overwrite in step 4 is in the bytes hashed at its end
    found = faulted_runs(tmp_path, at=4, new_tokens=7)
    assert found["clean"]["quick"] == found["faulted"]["quick"] == 3
    assert found["faulted"]["demoted"] == []
    clean, faulted = load_run(tmp_path / "clean"), load_run(tmp_path / "faulted")
    named_first(clean, faulted, ("r0", 4, "L0.attn.kv_written"), "L0.attn.out")


def test_an_overwritten_kv_row_of_a_settled_layer_is_named_by_a_diff(tmp_path: Path) -> None:
    # in steps that verify nothing in full, layer 1's points take the settled path (the
    # checks it shares with layer 0 made once per step): the same bytes, the same names
    found = faulted_runs(tmp_path, at=4, new_tokens=7, layer=1)
    assert found["clean"]["settled"] == found["faulted"]["settled"] > 0
    clean, faulted = load_run(tmp_path / "clean"), load_run(tmp_path / "faulted")
    named_first(clean, faulted, ("r0", 4, "L1.attn.kv_written"), "L1.attn.out")


def test_a_cache_column_written_through_a_version_counter_is_dropped() -> None:
    """Cache columns kept in place are dropped (and demoted) like any kept tensor when the
    keys' or the values' version counter moved before step end; inference tensors have
    none to compare."""
    deferred = DeferredHashes(torch.device("cpu"), budget=1 << 20)
    for touched in ("keys", "values"):
        deferred.reset("decode", 1)
        deferred.demoted.clear()
        cache = {"keys": torch.zeros(2, 2, 4, 8), "values": torch.zeros(2, 2, 4, 8)}
        kept = deferred.keep_cache(["w", "p"], cache["keys"], cache["values"], (3, 2), rows=2)
        assert kept == [0, 1] and deferred.moved() == []
        cache[touched][0, :, 3].add_(1.0)
        assert deferred.moved() == [0, 1] and set(deferred.demoted) == {"w", "p"}, touched
    deferred.reset("decode", 2)
    deferred.demoted.clear()
    with torch.inference_mode():
        keys, values = torch.zeros(2, 2, 4, 8), torch.zeros(2, 2, 4, 8)
        assert deferred.keep_cache(["w"], keys, values, (3,), rows=2) == [0]
        values.add_(1.0)
    assert deferred.moved() == [] and not deferred.demoted
