"""HFEngine generation: batching, agreement with transformers, sampling, stopping, errors."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from enginetap.core.context import Step, subscribe
from enginetap.engines.hf import HFEngine, Request
from enginetap.errors import ConfigError, EnginetapError

MODELS = ["llama", "qwen3_moe", "qwen3_next", "deepseek_v3"]


def random_prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 512) for _ in range(n - 1)] for n in lengths]


def greedy(prompts: list[list[int]], new: int = 8, prefix: str = "r") -> list[Request]:
    return [Request(f"{prefix}{i}", prompt_ids=p, max_new_tokens=new)
            for i, p in enumerate(prompts)]


@pytest.mark.parametrize("name", MODELS)
def test_batched_rows_equal_each_prompt_alone(name: str, hf_engine) -> None:
    engine = hf_engine(name)
    prompts = random_prompts(11, (9, 3, 17, 6))
    alone = [engine.generate(greedy([p]))[0] for p in prompts]
    batched = engine.generate(greedy(prompts))
    assert [c.request_id for c in batched] == ["r0", "r1", "r2", "r3"]
    assert [c.output_ids for c in batched] == [c.output_ids for c in alone]
    assert [c.prompt_ids for c in batched] == prompts
    for c in batched:
        assert c.finish_reason == ("stop" if c.output_ids[-1] in engine.eos_ids else "length")


@pytest.mark.parametrize("name", ["qwen3_next", "deepseek_v3"])
def test_greedy_tokens_equal_transformers_generate(name: str, hf_engine) -> None:
    engine = hf_engine(name)
    prompt = random_prompts(5, (13,))[0]
    ours = engine.generate(greedy([prompt], new=10))[0].output_ids
    ref = engine.model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                pad_token_id=0)
    assert ours == ref[0, len(prompt):].tolist()


def test_bf16_engine_matches_transformers_generate() -> None:
    engine = HFEngine.from_builtin("llama")  # the default dtype, bf16
    prompt = random_prompts(6, (10,))[0]
    ours = engine.generate(greedy([prompt], new=10))[0].output_ids
    ref = engine.model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)
    assert ours == ref[0, len(prompt):].tolist()


def test_seeded_sampling_is_reproducible_and_independent_of_batch_mates(hf_engine) -> None:
    engine = hf_engine("llama")
    p0, p1, p2 = random_prompts(21, (7, 12, 4))

    def sampled(rid: str, prompt: list[int], seed: int) -> Request:
        return Request(rid, prompt_ids=prompt, max_new_tokens=10, temperature=1.0, top_p=0.9,
                       seed=seed)

    first = engine.generate([sampled("a", p0, 7)])[0].output_ids
    assert engine.generate([sampled("a", p0, 7)])[0].output_ids == first
    mates = engine.generate([greedy([p1])[0], sampled("a", p0, 7), sampled("b", p2, 8)])
    assert mates[1].output_ids == first
    assert engine.generate([sampled("a", p0, 8)])[0].output_ids != first
    assert engine.generate(greedy([p0], new=10))[0].output_ids != first


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_finished_requests_leave_the_batch(name: str, hf_engine) -> None:
    engine = hf_engine(name)
    prompts = random_prompts(31, (5, 11, 8))
    expected = [c.output_ids for c in engine.generate(greedy(prompts))]
    stop_token = expected[1][2]  # the middle request stops after three tokens
    steps: list[Step] = []
    subscribe(on_begin=steps.append)
    saved = engine.eos_ids
    engine.eos_ids = {stop_token}
    try:
        got = engine.generate(greedy(prompts))
    finally:
        engine.eos_ids = saved
    assert got[1].finish_reason == "stop" and got[1].output_ids[-1] == stop_token
    for done, full in zip(got, expected):
        cut = full.index(stop_token) + 1 if stop_token in full else len(full)
        assert done.output_ids == full[:cut]
    longest = max(len(c.output_ids) for c in got)
    assert len(steps) == longest  # one prefill, then a decode per extra token
    for step in steps[1:]:
        alive = [c.request_id for c in got if len(c.output_ids) > step.step - steps[0].step]
        assert step.rows.request_ids == alive


def test_text_prompt_is_tokenized_and_decoded(hf_engine) -> None:
    engine = hf_engine("qwen3_moe")
    done = engine.generate([Request("t", prompt="kernels tile their inputs", max_new_tokens=6)])[0]
    assert done.prompt_ids[0] == 1
    assert engine.tokenizer.decode(done.prompt_ids[1:]) == "kernels tile their inputs"
    assert done.text == engine.tokenizer.decode(done.output_ids, skip_special_tokens=True)
    assert len(done.output_ids) == 6 or done.finish_reason == "stop"


@pytest.mark.parametrize("request_, message", [
    (Request("e", prompt_ids=[]), "prompt is empty"),
    (Request("e", prompt=""), "prompt is empty"),
    (Request("e"), "exactly one of"),
    (Request("e", prompt_ids=[1, 2], prompt="both"), "exactly one of"),
    (Request("e", prompt_ids=[1, 512]), "outside the vocabulary"),
    (Request("e", prompt_ids=[1] * 2040, max_new_tokens=16), "exceed the model's 2048"),
    (Request("e", prompt_ids=[1, 5], max_new_tokens=0), "max_new_tokens"),
    (Request("e", prompt_ids=[1, 5], top_p=0.0), "top_p"),
])
def test_bad_requests_raise_before_any_step(request_: Request, message: str, hf_engine) -> None:
    engine = hf_engine("llama")
    steps: list[Step] = []
    subscribe(on_begin=steps.append)
    before = engine.steps
    with pytest.raises(ConfigError, match=message):
        engine.generate([Request("ok", prompt_ids=[1, 7, 9]), request_])
    assert steps == [] and engine.steps == before


def test_duplicate_request_ids_are_refused(hf_engine) -> None:
    with pytest.raises(ConfigError, match="share a request_id"):
        hf_engine("llama").generate(greedy([[1, 4], [1, 5]], prefix="same") * 2)


def test_unknown_model_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(EnginetapError, match="no config.json"):
        HFEngine(tmp_path / "missing")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": "not_a_model"}')
    with pytest.raises(EnginetapError, match="cannot load a model"):
        HFEngine(tmp_path / "broken")


def test_empty_call_runs_no_step(hf_engine) -> None:
    engine = hf_engine("llama")
    before = engine.steps
    assert engine.generate([]) == [] and engine.steps == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_runs_on_gpu_like_transformers() -> None:
    engine = HFEngine.from_builtin("qwen3_moe", device="cuda", dtype=torch.float32)
    prompts = random_prompts(41, (6, 14))
    batched = [c.output_ids for c in engine.generate(greedy(prompts))]
    for prompt, ours in zip(prompts, batched):
        ref = engine.model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=8,
                                    do_sample=False)
        assert ours == ref[0, len(prompt):].tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_step_lines_are_written_during_the_next_steps_device_wait(tmp_path) -> None:
    """The engine announces its device waits on CUDA: the step recorder writes each line
    during the next step's wait, and disarm leaves every step's line on disk, in order,
    with the tokens of a disarmed run."""
    import json

    from enginetap.config import ArmConfig
    from enginetap.engines.hf.arming import disarm

    prompts = greedy(random_prompts(43, (6, 14)))
    plain = [c.output_ids for c in HFEngine.from_builtin(
        "llama", device="cuda", prefix_cache_size=0).generate(prompts)]
    config = ArmConfig(enabled=True, capabilities=["step"], out_dir=tmp_path)
    try:
        engine = HFEngine.from_builtin("llama", device="cuda", prefix_cache_size=0,
                                       arm=config)
        armed = [c.output_ids for c in engine.generate(prompts)]
        assert engine.arming is not None and engine.arming.context is not None
        assert engine.arming.context.notes["step_recorder"].deferring
    finally:
        disarm()
    lines = [json.loads(line) for line in (tmp_path / "steps-rank0.jsonl").read_text()
             .splitlines()]
    assert armed == plain
    assert [line["step"] for line in lines] == list(range(engine.steps))
