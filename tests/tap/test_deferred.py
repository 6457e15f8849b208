"""Deferred checkpoints (hashed in place at step end by one kernel) record what the gather
path records, and a tensor written after its checkpoint is caught, never recorded wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from enginetap.tap.deferred import DeferredHashes

pytest.importorskip("triton", reason="Triton is not installed")


def test_built_in_engine_deferred_equals_gathered_and_writes_are_caught() -> None:
    # On a GPU machine the real kernels run on the device; elsewhere Triton's interpreter
    # runs them on the CPU (the interpreter of Triton 3.6, on the H200 machine, fails on
    # kernels that 3.9's runs: there the device is the check).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    env = {**os.environ, "TRITON_INTERPRET": "1"} if device == "cpu" else dict(os.environ)
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("deferred_checks.py")),
                           device], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    for what, result in found.items():
        assert result["tokens_equal"], what  # armed either way: same tokens
        assert result["steps"] == 6 and result["differ"] == [], (what, result)
        assert result["equal"] == list(range(6)), (what, result)
        assert result["deferred"] > 60, (what, result)  # most checkpoints went deferred
    assert found["none"]["demoted"] == [] and found["none"]["dropped"] == []
    # bytes changed behind the version counter, every step: the first verification
    assert found["hidden"]["demoted"] == [
        "L0.post_norm.out: its bytes at step end differ from those at its checkpoint "
        "(something writes the tensor later in the step)"]
    # ... only at step 4: the periodic full verification (every 4 steps here)
    assert found["late"]["demoted"] == found["hidden"]["demoted"]
    # through the version counter, after verification: dropped from that step, demoted
    assert found["counted"]["dropped"] == [[3, ["L0.post_norm.out"]]]
    assert found["counted"]["demoted"] == [
        "L0.post_norm.out: modified in place after its checkpoint, before the step ended "
        "(its version counter moved)"]


def test_what_can_be_deferred() -> None:
    deferred = DeferredHashes(torch.device("cpu"), budget=4096)
    deferred.reset("decode", 1)
    words = torch.zeros(4, 64, dtype=torch.bfloat16)  # 512 bytes
    assert deferred.accepts("a", words)
    assert not deferred.accepts("b", torch.zeros(4, 3, dtype=torch.bfloat16))  # 6-byte rows
    assert not deferred.accepts("c", torch.zeros(4, 65, dtype=torch.bfloat16)[:, 1:])  # unaligned
    assert not deferred.accepts("d", torch.zeros(64, 64))  # 16 KiB: over the budget
    deferred.demoted["e"] = "test"
    assert not deferred.accepts("e", words)


def test_verification_and_version_counters() -> None:
    deferred = DeferredHashes(torch.device("cpu"), budget=1 << 20, verify=2, verify_every=10)
    for step in (1, 2, 3):
        deferred.reset("decode", step)
        assert deferred.needs_check("x") == (step <= 2)
    deferred.reset("prefill", 3)
    assert deferred.needs_check("x")  # a new kind of step is verified again
    deferred.reset("decode", 10)
    assert deferred.needs_check("x")  # every 10th step verifies everything
    deferred.reset("decode", 11)
    assert not deferred.needs_check("x")
    kept, touched = torch.zeros(2, 8), torch.zeros(2, 8)
    deferred.add("kept", kept)
    deferred.add("touched", touched)
    touched.add_(0)
    assert deferred.moved() == [1] and "touched" in deferred.demoted
    with torch.inference_mode():
        quiet = torch.zeros(2, 8)
    deferred.add("quiet", quiet)  # no version counter: verification is its guard
    assert deferred.moved() == [1]


def test_flags_a_step_late_verify_one_step_more() -> None:
    """Where a step's flags reach the host a step later (a GPU's transfer without a
    wait), every verification is followed by one more verified step, so no unverified
    step relies on a deferred hash whose check is still in flight."""
    deferred = DeferredHashes(torch.device("cpu"), budget=1 << 20, verify=2, verify_every=10,
                              lag=1)
    for step in (2, 3, 4, 5):  # (step 1 follows the full step 0)
        deferred.reset("decode", step)
        assert deferred.needs_check("x") == (step <= 4)
    for step, full in ((9, False), (10, True), (11, True), (12, False)):
        deferred.reset("decode", step)
        assert deferred.needs_check("x") == full
