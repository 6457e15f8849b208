"""Sampler findings tell a near tie that flipped from a confident flip."""

from __future__ import annotations

import pytest

from enginetap.core.context import current_step
from enginetap.core.patching import PatchSet
from enginetap.tap.pairs import find_pairs, sampler_findings

from .conftest import Recorder, requests

SAME = ["the cache holds every key", "the cache holds every key", "decode"]
TARGET = "transformers.models.llama.modeling_llama:LlamaForCausalLM.forward"


@pytest.mark.parametrize("margin,kind", [(1e-5, "tie flip"), (5.0, "confident flip")])
def test_a_flipped_token_is_classified_by_its_gap(record: Recorder, margin: float,
                                                  kind: str) -> None:
    def flip(wrapped, instance, args, kwargs):
        out = wrapped(*args, **kwargs)
        step = current_step()
        if step is not None and step.step == 2:
            b = step.rows.token_index[step.rows.rows_of_key("r1")[-1]]
            logits = out.logits[b, -1]
            second = logits.topk(2).indices[1]
            logits[second] = logits.max() + margin  # the runner-up now wins, by margin
        return out

    patches = PatchSet("test-flip")
    patches.add(TARGET, flip)
    with patches:  # installed before arming: the tap sees the flipped logits
        outputs, run = record("llama", requests(SAME))
    assert outputs[0] != outputs[1]
    (found,) = [f for f in sampler_findings(run.rank(0)) if f.keys == ("r0", "r1")]
    assert (found.step, found.kind) == (2, kind)
    assert found.tokens == (outputs[0][2], outputs[1][2])
    # every checkpoint agreed at that step: the split is the sampler's alone
    pair = next(p for p in find_pairs(run.rank(0)) if p.keys == ("r0", "r1"))
    assert not pair.split
