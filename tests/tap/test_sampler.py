"""Sampler findings tell a near tie that flipped from a confident flip."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from enginetap.core.context import current_step
from enginetap.core.patching import PatchSet
from enginetap.tap.analysis.pairs import find_pairs, sampler_findings

from .conftest import Recorder, requests

SAME = ["the cache holds every key", "the cache holds every key", "decode"]
TARGET = "transformers.models.llama.modeling_llama:LlamaForCausalLM.forward"


def _sampled_logits(out: Any, step_number: int, key: str) -> torch.Tensor | None:
    """The logits row the engine samples request ``key``'s token from, at that step."""
    step = current_step()
    if step is None or step.step != step_number:
        return None
    b = step.rows.token_index[step.rows.rows_of_key(key)[-1]]
    return out.logits[b, -1]


@pytest.mark.parametrize("margin,kind", [(1e-5, "tie flip"), (5.0, "confident flip")])
def test_a_flipped_token_is_classified_by_its_gap(record: Recorder, margin: float,
                                                  kind: str) -> None:
    def flip(wrapped, instance, args, kwargs):
        out = wrapped(*args, **kwargs)
        logits = _sampled_logits(out, 2, "r1")
        if logits is not None:
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


def test_a_masked_vocabulary_keeps_its_infinite_logits_in_the_record(record: Recorder) -> None:
    # Constrained decoding: at step 2 one token is allowed for r0, every other logit is
    # -inf. The runner-up's logit is written as -inf (not null), the other rows' finite.
    def mask(wrapped, instance, args, kwargs):
        out = wrapped(*args, **kwargs)
        logits = _sampled_logits(out, 2, "r0")
        if logits is not None:
            keep = int(logits.argmax())
            logits[:keep] = float("-inf")
            logits[keep + 1:] = float("-inf")
        return out

    patches = PatchSet("test-mask")
    patches.add(TARGET, mask)
    with patches:
        outputs, run = record("llama", requests(SAME))
    steps = {s.step: s for s in run.rank(0).steps}
    keys = [r["key"] for r in steps[2].rows]
    masked = steps[2].sampler[keys.index("r0")]
    assert masked["top2"] == float("-inf") and masked["gap"] == float("inf")
    assert masked["argmax"] == outputs[0][2]
    other = steps[2].sampler[keys.index("r1")]
    assert all(isinstance(other[k], float) and abs(other[k]) < 1e30
               for k in ("top1", "top2", "gap"))
    # the other steps hold finite logits (written by the fast encoder)
    assert all(abs(row["gap"]) < 1e30 for n, s in steps.items() if n != 2 for row in s.sampler)
