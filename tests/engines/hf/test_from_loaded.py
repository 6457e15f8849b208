"""``HFEngine.from_loaded`` as docs/capture.md ("Python") shows it: a model already in
memory is armed without a reload; the engine's ``generate`` is what capture and tap see,
and the user's own ``model.generate()`` publishes no step, so nothing is recorded there."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from enginetap.config import ArmConfig
from enginetap.core.jsonl import close_all
from enginetap.dataset import Dataset, validate_dataset
from enginetap.engines.hf import HFEngine, Request
from enginetap.engines.hf.arming import disarm
from enginetap.models import build_model


def _loaded(name: str) -> tuple[object, object]:
    folder = build_model(name)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(folder)


def test_the_documented_capture_snippet_writes_a_valid_dataset(tmp_path: Path) -> None:
    model, tokenizer = _loaded("llama")
    ds = tmp_path / "ds"
    arm = ArmConfig(enabled=True, capabilities=["capture"], out_dir=ds / "enginetap",
                    options={"capture": {"dataset": str(ds), "policy": "default"}})
    engine = HFEngine.from_loaded(model, tokenizer, arm=arm)
    assert engine.model is model  # the user's object, not a copy
    try:
        done = engine.generate([Request(request_id="a", prompt="hello", max_new_tokens=8),
                                Request(request_id="b", prompt_ids=[1, 5, 7], max_new_tokens=8)])
    finally:
        disarm()
    assert [len(c.output_ids) for c in done] == [8, 8]
    dataset = Dataset(ds)
    assert sum(len(dataset.workloads(n)) for n in dataset.definitions()) > 0
    assert validate_dataset(ds) == []


def test_own_generate_records_nothing_and_the_engines_generate_does(tmp_path: Path) -> None:
    model, tokenizer = _loaded("llama")
    out = tmp_path / "run"
    arm = ArmConfig(enabled=True, capabilities=["tap"], out_dir=out,
                    options={"tap": {}, "step": {"record": False}})
    engine = HFEngine.from_loaded(model, tokenizer, arm=arm)
    ids = [1, 5, 7, 9]
    try:
        own = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
        taps = sorted(out.glob("tap-rank*.jsonl"))
        assert taps == [] or all(json.loads(line)["kind"] == "header" for path in taps
                                 for line in path.read_text().splitlines())
        done = engine.generate([Request(request_id="p0", prompt_ids=ids, max_new_tokens=4)])
    finally:
        disarm()
        close_all()
    assert done[0].output_ids == own[0, len(ids):].tolist()  # same greedy tokens
    records = [json.loads(line) for line in (out / "tap-rank0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "step"] == [0, 1, 2, 3]
    # disarmed: the model's classes hold their own methods again, and it still generates
    again = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
    assert torch.equal(again, own)
