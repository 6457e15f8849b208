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

from enginetap.tap.record.deferred import DeferredHashes

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
        steps = 14 if what.startswith("quick") else 6
        assert result["tokens_equal"], what  # armed either way: same tokens
        assert result["steps"] == steps and result["differ"] == [], (what, result)
        assert result["equal"] == list(range(steps)), (what, result)
        assert result["deferred"] > 60, (what, result)  # most checkpoints went deferred
    assert found["none"]["demoted"] == [] and found["none"]["dropped"] == []
    # bytes changed behind the version counter, every step: the first verification
    assert found["hidden"]["demoted"] == [
        "L0.post_norm.out: its bytes at step end differ from those at its checkpoint "
        "(something writes the tensor later in the step)"]
    # ... only at step 4: the periodic full verification (every 4 steps here)
    assert found["late"]["demoted"] == found["hidden"]["demoted"]
    # through the version counter: demoted; at step 3, past its verifications on the CPU,
    # its deferred hash is dropped from that step. On a GPU, where flags reach the host a
    # step later, step 3 is still verified (staged as well): the staged hash is recorded.
    assert found["counted"]["dropped"] == ([] if device == "cuda"
                                           else [[3, ["L0.post_norm.out"]]])
    assert found["counted"]["demoted"] == [
        "L0.post_norm.out: modified in place after its checkpoint, before the step ended "
        "(its version counter moved)"]
    # Quick steps: the decode steps after the first one that verified nothing (decode
    # steps 1-2 verify on the CPU, 1-3 on a GPU, where flags land a step late).
    first_quick = 4 if device == "cpu" else 5
    assert found["quick-none"]["quick"] == 14 - first_quick
    assert found["quick-none"]["dropped"] == [] and found["quick-none"]["demoted"] == []
    assert (found["none"]["quick"], found["hidden"]["quick"]) == ((1, 1) if device == "cpu"
                                                                  else (0, 0))
    # A checkpoint new in a quick step (6) is left out of it, named, and verified in the
    # next steps (7-9 on the CPU, 7-10 on a GPU) before quick steps resume.
    assert found["quick-new"]["dropped"] == [[6, ["L0.post_norm.out#2"]]]
    assert found["quick-new"]["quick"] == (3 + 4 if device == "cpu" else 2 + 3)
    # A write through the version counter from step 8 on, seen when the quick step's
    # checkpoints are examined: left out of step 8, gathered at its call from step 9.
    assert found["quick-counted"]["dropped"] == [[8, ["L0.post_norm.out"]]]
    assert found["quick-counted"]["demoted"] == found["counted"]["demoted"]
    # A non-contiguous output (L0.mlp.out, rows twice their width apart) is kept through
    # its row view in quick steps too: recorded like the gather path, nothing left out.
    assert found["quick-strided"]["quick"] == found["quick-none"]["quick"]
    assert found["quick-strided"]["dropped"] == [] and found["quick-strided"]["demoted"] == []
    # Where a patch may split forwards' rows across ranks, no step runs quick.
    assert found["quick-split"]["quick"] == 0 and found["quick-split"]["dropped"] == []
    # A quick step whose list matches the last one's plan is kept whole (QuickPlan): every
    # quick step but the first of a run; not a step whose list differs (a new name, or
    # other shapes once a request finished and the batch shrank), which is examined one by
    # one and planned anew; never tensors with version counters or a strided one.
    assert found["quick-none"]["planned"] == found["quick-none"]["quick"] - 1
    assert found["quick-new"]["planned"] == found["quick-new"]["quick"] - 3
    assert {2, 3} <= set(found["quick-shrink"]["rows"]) and found["quick-shrink"]["dropped"] == []
    assert found["quick-shrink"]["planned"] == found["quick-shrink"]["quick"] - 2
    assert found["quick-counted"]["planned"] == found["quick-strided"]["planned"] == 0


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



def test_kept_without_a_view_is_hashed_like_its_row_view() -> None:
    """The checkpoint's fast path keeps a contiguous tensor as it is (no row view made):
    the hash kernel's table must then read the same words as through the view."""
    deferred = DeferredHashes(torch.device("cpu"), budget=1 << 20)
    deferred.reset("decode", 1)
    prefill = torch.arange(4 * 2 * 64, dtype=torch.float32).to(torch.bfloat16).view(4, 2, 64)
    assert deferred.keep("fast", prefill, words=prefill.nbytes // 8 // 4,
                         nbytes=prefill.nbytes) == 0  # 8 token rows of 128 bytes
    deferred.add("view", prefill.view(8, -1))
    assert _columns(deferred)[0] == _columns(deferred)[1] == (prefill.data_ptr(), 32, 32)
    assert deferred.tensors[0] is prefill
    strided = torch.zeros(8, 96, dtype=torch.bfloat16)[:, :64]  # rows 192 bytes apart
    assert deferred.accepts("strided", strided)
    deferred.add("strided", strided)
    assert _columns(deferred)[2] == (strided.data_ptr(), 48, 32)
    assert deferred.held == prefill.nbytes + strided.shape[0] * strided.stride(0) * 2
    deferred.demoted["gone"] = "test"
    assert deferred.keep("gone", prefill, words=32, nbytes=prefill.nbytes) == -1
    assert deferred.keep("big", prefill, words=32, nbytes=1 << 20) == -1  # over the budget
    assert len(deferred.tensors) == len(_columns(deferred)) == 3


def _columns(deferred: DeferredHashes) -> list[tuple[int, int, int]]:
    return list(zip(deferred.addresses, deferred.strides, deferred.widths, strict=True))


def test_kept_as_a_list_equals_kept_one_by_one() -> None:
    """A quick step's planned checkpoints are kept in one call: the same table, tensors,
    names and bytes held as keeping them one by one."""
    with torch.inference_mode():  # as an engine's forward makes them (no version counter)
        tensors = [torch.randn(8, 64), torch.randn(8, 2, 16).to(torch.bfloat16)]
    words = [64, 8]
    one = DeferredHashes(torch.device("cpu"), budget=1 << 20)
    many = DeferredHashes(torch.device("cpu"), budget=1 << 20)
    for d in (one, many):
        d.reset("decode", 1)
        d.keep("first", tensors[0], words=64, nbytes=tensors[0].nbytes)
    slots = [one.keep(n, t, words=w, nbytes=t.nbytes) for n, t, w in zip("ab", tensors, words)]
    assert many.keep_listed(["a", "b"], tensors, [t.data_ptr() for t in tensors], words,
                            sum(t.nbytes for t in tensors)) == slots[0] == 1
    assert _columns(many) == _columns(one) and many.names == one.names == ["first", "a", "b"]
    assert many.versions == one.versions and many.held == one.held
    assert all(a is b for a, b in zip(many.tensors, one.tensors))

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


def test_flags_read_a_step_late_demote_their_own_steps_names() -> None:
    """On a GPU a step's verification flags are read at the next step's end, when the
    deferred state already lists that next step's checks (one fewer once a name is
    demoted): each flag must still demote the name it verified."""
    deferred = DeferredHashes(torch.device("cpu"), budget=1 << 20, verify=3, lag=1)
    deferred.reset("decode", 1)
    deferred.checks = [("a", 0, 0), ("b", 1, 1), ("c", 2, 2)]
    late = [name for name, _, _ in deferred.checks]  # what the recorder keeps with the flags
    deferred.reset("decode", 2)
    deferred.checks = [("a", 0, 0), ("c", 1, 1)]  # the next step's, before the flags land
    deferred.compare_flags(torch.tensor([1, 0, 1]), late)
    assert list(deferred.demoted) == ["b"]
    deferred.compare_flags(torch.tensor([1, 0]))  # read in its own step: its own checks
    assert list(deferred.demoted) == ["b", "c"]
    with pytest.raises(ValueError):  # flags and names that do not pair up are a bug
        deferred.compare_flags(torch.tensor([1, 1, 1]))
