"""Instrumentation never changes the built-in engine's outputs.

Armed here means what capture and tap will do: a pass-through wrapper on every decoder
layer, attention, MoE and norm class of the model (through the patching layer) and a step
listener reading each step's rows. Disarmed and armed runs must give identical tokens in
the model's own dtype (bf16), where any perturbation would show as flipped near-ties.
"""

from __future__ import annotations

import pytest
import torch

from enginetap.core.context import subscribe, unsubscribe
from enginetap.core.patching import PatchSet
from enginetap.engines.hf import HFEngine, Request
from enginetap.engines.hf.targets import sublayer_targets

def arm(model: torch.nn.Module, calls: list[str]) -> PatchSet:
    patches = PatchSet("armed-test")
    for target in sublayer_targets(model):
        def spy(wrapped, instance, args, kwargs, name=target):
            calls.append(name)
            return wrapped(*args, **kwargs)
        patches.add(target, spy)
    return patches


def _requests() -> list[Request]:
    prompts = ["kernels and caches", "a longer prompt about batching requests together",
               "decode"]
    return [Request(request_id=f"r{i}", prompt=p, max_new_tokens=6) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("name", ["llama", "qwen3_next", "deepseek_v3"])
def test_armed_and_disarmed_runs_produce_identical_tokens(name: str) -> None:
    engine = HFEngine.from_builtin(name, dtype=torch.bfloat16, prefix_cache_size=0)
    disarmed = [c.output_ids for c in engine.generate(_requests())]
    calls: list[str] = []
    rows: list[int] = []
    listener = lambda step: rows.append(len(step.rows))  # noqa: E731
    subscribe(on_begin=listener)
    try:
        with arm(engine.model, calls):
            armed = [c.output_ids for c in engine.generate(_requests())]
    finally:
        unsubscribe(listener)
    assert armed == disarmed
    assert rows and len(set(calls)) >= 3
    assert any(t.endswith("DecoderLayer.forward") for t in calls)
    assert [c.output_ids for c in engine.generate(_requests())] == disarmed
