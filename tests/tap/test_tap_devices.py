"""The tap on the built-in engine per device: tokens unchanged, identical requests never
split, nothing discontinuous, valid lengths recorded — on the CPU, and on CUDA (skipped
without one), where checkpoints are deferred (hashed in place at step end by one kernel)
and the engine's valid lengths arrive only when the step's sampling is done."""

from __future__ import annotations

import pytest
import torch

from enginetap.config import ArmConfig
from enginetap.core.jsonl import close_all
from enginetap.engines.hf import HFEngine
from enginetap.engines.hf.arming import disarm
from enginetap.tap.analysis.continuity import check_continuity, check_metadata
from enginetap.tap.analysis.files import load_run
from enginetap.tap.analysis.pairs import find_pairs

from .conftest import requests

PROMPTS = ["the cache holds every key", "kernels", "the cache holds every key",
           "a longer prompt than the others, padded against them"]

DEVICES = [pytest.param("cpu"),
           pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
               not torch.cuda.is_available(), reason="needs a CUDA device")])]


@pytest.mark.parametrize("device", DEVICES)
def test_tap_keeps_tokens_and_finds_nothing_wrong(tmp_path, device: str) -> None:
    reqs = requests(PROMPTS, max_new_tokens=6)
    disarmed = [c.output_ids for c in HFEngine.from_builtin(
        "llama", device=device, prefix_cache_size=0).generate(reqs)]
    config = ArmConfig(enabled=True, capabilities=["tap"], out_dir=tmp_path / "run")
    try:
        engine = HFEngine.from_builtin("llama", device=device, prefix_cache_size=0,
                                       arm=config)
        armed = [c.output_ids for c in engine.generate(reqs)]
        recorder = engine.arming.context.notes["tap"]
        deferred, checkpoints = recorder.last_deferred, recorder.last_checkpoints
    finally:
        disarm()
        close_all()
    assert armed == disarmed
    rank = load_run(tmp_path / "run").rank(0)
    assert len(rank.steps) == 6 and checkpoints > 0
    if device == "cuda":  # every sublayer output is deferred where Triton runs
        assert deferred > 0
    pair = {p.keys: p for p in find_pairs(rank)}[("r0", "r2")]
    assert pair.rows_compared >= len(rank.steps)
    if device == "cpu":
        assert not pair.split, pair
    elif pair.split:  # a GPU need not be batch-invariant; a split must then be placed
        assert pair.checkpoint and pair.splits, pair
    assert check_continuity(rank) == [] and check_metadata(rank) == []
    for step in rank.steps:  # filled at step end on CUDA, checked against the plan above
        assert all(r["query_len"] is not None and r["seq_len"] is not None
                   for r in step.rows)
