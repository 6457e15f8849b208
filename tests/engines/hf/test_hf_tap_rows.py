"""The tap's rows through the built-in engine's own loop while the batch changes under
it (requests finishing at different steps, a second generate whose prompts hit the
prefix cache, a request filter): every row's token and prefix hash are those of the
request's real tokens, the prefix None exactly where earlier tokens were never seen."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from enginetap.config import ArmConfig
from enginetap.core.jsonl import close_all
from enginetap.engines.hf import HFEngine, Request
from enginetap.engines.hf.arming import disarm
from enginetap.models import build_model
from enginetap.tap.record.rows import _BASE, _PRIME


def _prefixes(tokens: list[int]) -> list[str]:
    out, h = [], 0
    for tok in tokens:
        h = (h * _BASE + tok + 1) % _PRIME
        out.append(f"{h:016x}")
    return out


@pytest.mark.parametrize("request_filter", [None, "keep"])
def test_rows_and_prefixes_follow_the_batch_as_it_changes(tmp_path: Path,
                                                          request_filter: str | None) -> None:
    folder = build_model("llama")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = tmp_path / "run"
    tap: dict[str, Any] = {} if request_filter is None else {"request_filter": request_filter}
    arm = ArmConfig(enabled=True, capabilities=["tap"], out_dir=out,
                    options={"tap": tap, "step": {"record": False}})
    engine = HFEngine.from_loaded(model, AutoTokenizer.from_pretrained(folder),
                                  prefix_cache_size=16, arm=arm)
    prompts = [[5, 9, 13, 2, 7, 11, 3, 8], [4, 6], [10, 12, 14, 16, 18], [21, 22, 23]]
    lengths = [3, 9, 6, 12]  # finishing at different steps: the batch shrinks 3 times
    rounds = []
    try:
        for r in range(2):  # the second: the same prompts again, from the prefix cache
            done = engine.generate([
                Request(request_id=f"{'keep' if i % 2 == 0 else 'skip'}{r}-{i}", prompt_ids=p,
                        max_new_tokens=n) for i, (p, n) in enumerate(zip(prompts, lengths))])
            rounds.append(done)
    finally:
        disarm()
        close_all()
    assert engine.prefix_reuse  # the second round's prompts did hit the prefix cache
    tokens = {c.request_id: c.prompt_ids + c.output_ids for done in rounds for c in done}
    records = [json.loads(line) for line in (out / "tap-rank0.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    if request_filter is None:  # every step recorded: none lost to an error in the tap
        assert [r["step"] for r in steps] == list(range(engine.steps))
        assert all(r["rows"] for r in steps)
    seen: dict[str, list[int]] = {}
    unseen = carried = 0
    for record in steps:
        for row in record["rows"]:
            key, pos = row["key"], row["pos"]
            assert request_filter is None or request_filter in key
            assert row["tok"] == tokens[key][pos]
            positions = seen.setdefault(key, [])
            from_zero = positions[:1] == [0] and positions == list(range(len(positions)))
            if pos == 0 or (from_zero and positions[-1] == pos - 1):
                assert row["prefix"] == _prefixes(tokens[key])[pos], (record["step"], row)
                carried += record["mode"] == "decode"
            else:  # its earlier tokens came from the prefix cache: never seen
                assert row["prefix"] is None, (record["step"], row)
                unseen += 1
            positions.append(pos)
    sizes = [len(r["rows"]) for r in steps if r["mode"] == "decode"]
    assert len(set(sizes)) >= (3 if request_filter is None else 2)  # the batch changed
    assert carried > 5 and unseen > 0
