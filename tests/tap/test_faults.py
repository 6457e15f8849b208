"""Injected faults are named at exactly the place they were injected.

The injections are test code: a wrapper (installed before the engine arms, so the tap
sees its effect) that corrupts one request's row at one layer's sublayer at one step,
and patches of the engine's step that overwrite another request's recurrent state or KV
row between steps.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from enginetap.core.context import current_step
from enginetap.core.patching import PatchSet
from enginetap.engines.hf import HFEngine
from enginetap.tap.analysis.continuity import check_continuity
from enginetap.tap.analysis.diff import diff_runs
from enginetap.tap.analysis.pairs import find_pairs

from .conftest import Recorder, overwrite_between_steps, requests

SAME = ["the cache holds every key", "the cache holds every key", "kernels and caches"]


def _row_of(key: str) -> int:
    step = current_step()
    assert step is not None and step.rows.token_index is not None
    return step.rows.token_index[step.rows.rows_of_key(key)[-1]]


MLP = "transformers.models.llama.modeling_llama:LlamaMLP.forward"


@pytest.mark.parametrize("model,target,layer,checkpoint,agrees,options", [
    ("llama", MLP, "mlp", "L1.mlp.out", "L1.post_norm.out", {}),
    ("qwen3_next", "transformers.models.qwen3_next.modeling_qwen3_next:"
     "Qwen3NextGatedDeltaNet.forward", "linear_attn", "L1.gdn.out", "L1.gdn.conv_before", {}),
    # depth="layers": no sublayer checkpoint, the fault is named at its decoder layer
    ("llama", MLP, "mlp", "L1.out", "L1.in", {"depth": "layers"}),
], ids=["llama-mlp", "qwen3_next-gdn", "llama-mlp-layers-only"])
def test_a_corrupted_row_is_named_by_the_pair_analysis(record: Recorder, model: str,
                                                       target: str, layer: str,
                                                       checkpoint: str, agrees: str,
                                                       options: dict[str, Any]) -> None:
    fault_step = 2
    victim: dict[str, Any] = {}

    def corrupt(wrapped, instance, args, kwargs):
        out = wrapped(*args, **kwargs)
        step = current_step()
        if instance is victim.get("module") and step is not None and step.step == fault_step:
            out = out.clone()
            out.view(-1, out.shape[-1])[_row_of("r1"), 0] += 0.5
        return out

    original = HFEngine.__init__

    def remember(self, *args, **kwargs):
        original(self, *args, **kwargs)
        victim["module"] = getattr(self.model.model.layers[1], layer)

    _, clean = record(model, requests(SAME), **options)
    faults = PatchSet("test-fault")
    faults.add(target, corrupt)
    with faults, pytest.MonkeyPatch.context() as mp:
        mp.setattr(HFEngine, "__init__", remember)
        _, run = record(model, requests(SAME), **options)
    if options.get("depth") == "layers":  # layers' in/out and the KV points, nothing else
        names = {n.split("#")[0] for step in run.rank(0).steps for n in step.checkpoints}
        assert names and all(re.fullmatch(r"L\d+\.(in|out|attn\.kv_written|attn\.kv_prev)", n)
                             for n in names), sorted(names)
    # Against the same run without the fault, the diff names it wherever the engine runs.
    (diff,) = diff_runs(clean, run)
    assert diff.first is not None
    assert (diff.first.key, diff.first.step_a, diff.first.checkpoint) == ("r1", fault_step,
                                                                           checkpoint)
    pair = {p.keys: p for p in find_pairs(run.rank(0))}[("r0", "r1")]
    assert pair.rows_compared >= fault_step + 1
    before = {p.keys: p for p in find_pairs(clean.rank(0))}[("r0", "r1")]
    if before.split:
        # Some CPU paths split identical rows on their own: MKL's AVX2 GEMMs (AMD EPYC)
        # give a row's last bits by its place in the matrix, and qwen3_next's MoE experts
        # multiply a varying number of rows. The faulted pair then first splits at the
        # earlier of the engine's own split and the fault (execution order in the step).
        assert model == "qwen3_next", "the llama cases split on no CPU path seen so far"
        assert before.first_step is not None and before.checkpoint is not None
        step = next(s for s in run.rank(0).steps if s.step == fault_step)
        fault = (fault_step, step.checkpoints.index(checkpoint))
        own_step = next(s for s in run.rank(0).steps if s.step == before.first_step)
        own = (before.first_step, own_step.checkpoints.index(before.checkpoint))
        if own < fault:
            assert (pair.first_step, pair.checkpoint) == (before.first_step, before.checkpoint)
            return
    assert (pair.first_step, pair.checkpoint, pair.agreeing_input) == (fault_step, checkpoint,
                                                                       agrees)


def test_an_overwritten_recurrent_state_slot_is_named(record: Recorder) -> None:
    def write(cache):
        states = cache.layers[1].recurrent_states[0]
        states[1].copy_(states[2])  # request r2's state lands in r1's slot

    with pytest.MonkeyPatch.context() as mp:
        overwrite_between_steps(mp, 2, write)
        _, run = record("qwen3_next", requests(SAME))
    found = [v for v in check_continuity(run.rank(0)) if v.kind == "state"]
    assert found, "the overwrite was not seen"
    first = found[0]
    assert (first.step, first.checkpoint, first.key, first.slot) == (3, "L1.gdn.state_before",
                                                                      "r1", 1)
    assert {v.key for v in found} == {"r1"}
    assert {v.checkpoint.split(".")[0] for v in found} == {"L1"}


def test_an_overwritten_kv_row_is_named(record: Recorder) -> None:
    written: dict[str, int] = {}

    def write(cache):
        keys = cache.layers[0].keys
        written["column"] = keys.shape[2] - 1
        keys[0, :, -1].copy_(keys[2, :, -1])  # r2's newest key lands in r0's row

    with pytest.MonkeyPatch.context() as mp:
        overwrite_between_steps(mp, 1, write)
        outputs, run = record("llama", requests(SAME))
    found = [v for v in check_continuity(run.rank(0)) if v.kind == "kv"]
    assert found, "the overwrite was not seen"
    first = found[0]
    step1 = next(s for s in run.rank(0).steps if s.step == 1)
    r0 = next(r for r in step1.rows if r["key"] == "r0")
    assert (first.step, first.checkpoint, first.key, first.position, first.slot) == (
        2, "L0.attn.kv_written", "r0", r0["pos"], r0["kv_slot"])
    assert {(v.key, v.checkpoint) for v in found} == {("r0", "L0.attn.kv_written")}


def test_a_mask_that_hides_a_cached_token_is_named_by_the_metadata_check(
        record: Recorder) -> None:
    """A decode step whose attention mask drops one of r1's cached columns (a padding
    bug): the kernels' sequence length no longer equals computed + planned tokens."""
    from enginetap.engines.hf import engine as engine_module
    from enginetap.tap.analysis.continuity import check_metadata, metadata_checked

    original = engine_module.plan_decode
    calls = {"n": 0}

    def drop_a_column(seqs, mask, capacity, recurrent):
        plan = original(seqs, mask, capacity, recurrent)
        calls["n"] += 1
        if calls["n"] == 2:  # the second decode step
            b = next(i for i, s in enumerate(seqs) if s.request.request_id == "r1")
            plan.attention_mask[b, -2] = 0
        return plan

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_module, "plan_decode", drop_a_column)
        _, run = record("llama", requests(SAME, max_new_tokens=4))
    rank = run.rank(0)
    found = check_metadata(rank)
    assert found and {(v.kind, v.key) for v in found} == {("seq_len", "r1")}
    first = found[0]
    step2 = next(s for s in rank.steps if s.step == 2)
    r1 = next(r for r in step2.rows if r["key"] == "r1")
    assert (first.step, first.position) == (2, r1["pos"])
    assert f"expected {r1['computed_host']} computed + 1 planned" in first.detail
    rows = sum(len(s.rows) for s in rank.steps)
    assert metadata_checked(rank)["lengths"] == rows
