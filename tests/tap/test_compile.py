"""A checkpoint reached while torch.compile traces is refused, with the reason, unless
``force``: recorded there, its staging would be traced into the graph.

One decoder layer's MLP of the built-in engine is compiled on the CPU; with
``inputs="all"`` its tap wrapper stages ``L1.mlp.in`` before calling the module, while
dynamo traces it. The backend is ``eager``: the refusal happens while dynamo traces,
whatever backend turns the graph into code (and ``eager`` needs no C++ compiler).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

from enginetap.engines.hf import HFEngine

from .conftest import Recorder, requests

PROMPTS = ["the cache holds every key", "decode"]


@pytest.fixture
def compiled_mlp(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every engine built in the test has layer 1's MLP compiled."""
    original = HFEngine._setup

    def setup(self, model, tokenizer, prefix_cache_size):
        original(self, model, tokenizer, prefix_cache_size)  # the tap names modules here
        layers = model.model.layers
        layers[1].mlp = torch.compile(layers[1].mlp, backend="eager")

    torch._dynamo.reset()
    monkeypatch.setattr(HFEngine, "_setup", setup)
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("force", [False, True])
def test_a_checkpoint_under_compile_tracing_is_refused_unless_forced(
        record: Recorder, compiled_mlp: None, caplog: pytest.LogCaptureFixture,
        force: bool) -> None:
    caplog.set_level(logging.WARNING, logger="enginetap.tap")
    outputs, run = record("llama", requests(PROMPTS, max_new_tokens=3), inputs="all",
                          force=force)
    steps = run.rank(0).steps
    assert all("L0.mlp.in" in s.checkpoints and "L0.mlp.out" in s.checkpoints for s in steps)
    refused = "tap: L1.mlp.in not recorded under torch.compile"
    if force:
        assert all("L1.mlp.in" in s.checkpoints and "L1.mlp.out" in s.checkpoints
                   for s in steps)
        assert "not recorded under torch.compile" not in caplog.text
    else:
        assert not any("L1.mlp.in" in s.checkpoints for s in steps)
        assert refused in caplog.text and "set options.tap.force" in caplog.text
        assert caplog.text.count(refused) == 1  # said once, not every step
        # The output checkpoint is refused as well where dynamo traces the whole wrapper,
        # recorded where a graph break before it leaves it to run eagerly (this depends
        # on what else wraps the module): never in some steps and not in others.
        assert len({"L1.mlp.out" in s.checkpoints for s in steps}) == 1
    plain = HFEngine.from_builtin("llama", dtype=torch.float32, prefix_cache_size=0)
    assert [c.output_ids for c in plain.generate(requests(PROMPTS, max_new_tokens=3))] == outputs
