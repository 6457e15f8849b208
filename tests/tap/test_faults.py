"""Injected faults are named at exactly the place they were injected.

The injections are test code: a wrapper (installed before the engine arms, so the tap
sees its effect) that corrupts one request's row at one layer's sublayer at one step,
and patches of the engine's step that overwrite another request's recurrent state or KV
row between steps.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from enginetap.core.context import current_step
from enginetap.core.patching import PatchSet
from enginetap.engines.hf import HFEngine
from enginetap.tap.continuity import check_continuity
from enginetap.tap.pairs import find_pairs

from .conftest import Recorder, requests

SAME = ["the cache holds every key", "the cache holds every key", "kernels and caches"]


def _row_of(key: str) -> int:
    step = current_step()
    assert step is not None and step.rows.token_index is not None
    return step.rows.token_index[step.rows.rows_of_key(key)[-1]]


@pytest.mark.parametrize("model,target,layer,checkpoint,agrees", [
    ("llama", "transformers.models.llama.modeling_llama:LlamaMLP.forward", "mlp",
     "L1.mlp.out", "L1.post_norm.out"),
    ("qwen3_next", "transformers.models.qwen3_next.modeling_qwen3_next:"
     "Qwen3NextGatedDeltaNet.forward", "linear_attn", "L1.gdn.out", "L1.gdn.conv_before"),
])
def test_a_corrupted_row_is_named_by_the_pair_analysis(record: Recorder, model: str,
                                                       target: str, layer: str,
                                                       checkpoint: str, agrees: str) -> None:
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

    faults = PatchSet("test-fault")
    faults.add(target, corrupt)
    with faults, pytest.MonkeyPatch.context() as mp:
        mp.setattr(HFEngine, "__init__", remember)
        _, run = record(model, requests(SAME))
    pairs = {p.keys: p for p in find_pairs(run.rank(0))}
    pair = pairs[("r0", "r1")]
    assert pair.rows_compared >= fault_step + 1
    assert (pair.first_step, pair.checkpoint, pair.agreeing_input) == (fault_step, checkpoint,
                                                                       agrees)


def _overwrite_between_steps(mp: pytest.MonkeyPatch, at_step: int, write: Any) -> None:
    """After step ``at_step`` sampled (still inside it), run ``write(cache)``."""
    original = HFEngine._advance

    def advance(self, seqs, logits, cache, mask):
        result = original(self, seqs, logits, cache, mask)
        if self.steps == at_step:
            write(cache)
        return result

    mp.setattr(HFEngine, "_advance", advance)


def test_an_overwritten_recurrent_state_slot_is_named(record: Recorder) -> None:
    def write(cache):
        states = cache.layers[1].recurrent_states[0]
        states[1].copy_(states[2])  # request r2's state lands in r1's slot

    with pytest.MonkeyPatch.context() as mp:
        _overwrite_between_steps(mp, 2, write)
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
        _overwrite_between_steps(mp, 1, write)
        outputs, run = record("llama", requests(SAME))
    found = [v for v in check_continuity(run.rank(0)) if v.kind == "kv"]
    assert found, "the overwrite was not seen"
    first = found[0]
    step1 = next(s for s in run.rank(0).steps if s.step == 1)
    r0 = next(r for r in step1.rows if r["key"] == "r0")
    assert (first.step, first.checkpoint, first.key, first.position, first.slot) == (
        2, "L0.attn.kv_written", "r0", r0["pos"], r0["kv_slot"])
    assert {(v.key, v.checkpoint) for v in found} == {("r0", "L0.attn.kv_written")}
