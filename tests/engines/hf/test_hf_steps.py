"""HFEngine's published steps: rows, numbering, placement metadata, prefix reuse."""

from __future__ import annotations

import random

import pytest

from enginetap.core.context import Step, current_step, subscribe
from enginetap.engines.hf import Request


def prompts_of(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 512) for _ in range(n - 1)] for n in lengths]


def run(engine, prompts: list[list[int]], new: int = 5, tag: str = "q"):
    steps: list[Step] = []
    seen_inside: list[Step | None] = []
    subscribe(on_begin=steps.append)
    hook = engine.model.register_forward_pre_hook(lambda *_: seen_inside.append(current_step()))
    try:
        done = engine.generate([Request(f"{tag}{i}", prompt_ids=p, max_new_tokens=new)
                                for i, p in enumerate(prompts)])
    finally:
        hook.remove()
    assert seen_inside == steps and current_step() is None  # a step wraps each forward
    return done, steps


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_prefill_and_decode_rows_match_the_schedule(name: str, hf_engine) -> None:
    engine = hf_engine(name)
    prompts = prompts_of(3, (4, 7))
    first = engine.steps
    done, steps = run(engine, prompts)
    assert [s.step for s in steps] == list(range(first, first + len(steps)))
    assert {s.engine for s in steps} == {"transformers"}
    prefill, decodes = steps[0], steps[1:]
    assert prefill.mode == "prefill" and all(s.mode == "decode" for s in decodes)
    rows = prefill.rows
    assert rows.request_ids == ["q0"] * 4 + ["q1"] * 7
    assert rows.positions == list(range(4)) + list(range(7))
    assert rows.token_ids == prompts[0] + prompts[1]
    assert rows.query_start == [0] * 4 + [4] * 7 and rows.computed_host == [0] * 11
    assert prefill.extra["input_shape"] == [2, 7]
    assert rows.token_index == [3, 4, 5, 6] + list(range(7, 14))
    assert prefill.padded_tokens == 14 and rows.keys == rows.request_ids
    # the step ends after sampling: each request's first output token is on the step
    assert prefill.sampled == {c.request_id: c.output_ids[0] for c in done}
    kv_seen = set(rows.kv_slots)
    for k, step in enumerate(decodes):
        alive = [c for c in done if len(c.output_ids) > k + 1]
        assert step.rows.request_ids == [c.request_id for c in alive]
        assert step.rows.positions == [len(c.prompt_ids) + k for c in alive]
        assert step.rows.token_ids == [c.output_ids[k] for c in alive]
        assert step.rows.computed_host == step.rows.positions
        assert step.rows.query_start == list(range(len(alive)))
        assert step.sampled == {c.request_id: c.output_ids[k + 1] for c in alive}
        assert not kv_seen & set(step.rows.kv_slots)  # every token gets its own slot
        kv_seen |= set(step.rows.kv_slots)
    recurrent = name == "qwen3_next"
    assert (rows.state_slots == [0] * 4 + [1] * 7) if recurrent else rows.state_slots is None


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_prefix_reuse_prefills_only_the_suffix_and_keeps_tokens(name: str, hf_engine) -> None:
    engine, plain = hf_engine(name, prefix=True), hf_engine(name)
    a, b, c = prompts_of(9, (6, 9, 5))
    engine.generate([Request("a", prompt_ids=a, max_new_tokens=2),
                     Request("b", prompt_ids=b, max_new_tokens=2)])
    second = [a + [40, 41, 42], b, c]  # a extended, b repeated, c shares only BOS
    reused, steps = run(engine, second, new=6)
    expected = plain.generate([Request(f"q{i}", prompt_ids=p, max_new_tokens=6)
                               for i, p in enumerate(second)])
    assert [x.output_ids for x in reused] == [x.output_ids for x in expected]
    rows = steps[0].rows
    assert rows.request_ids == ["q0"] * 3 + ["q1"] + ["q2"] * 4
    assert rows.positions == [6, 7, 8, 8] + list(range(1, 5))
    assert rows.token_ids == [40, 41, 42, b[-1]] + c[1:]
    assert rows.computed_host == [6, 6, 6, 8] + [1] * 4
    assert rows.query_start == [0] * 3 + [3] + [4] * 4
    assert engine.prefix_reuse


def test_recurrent_model_never_reuses_a_prefix(hf_engine) -> None:
    engine = hf_engine("qwen3_next", prefix=True)
    prompt = prompts_of(4, (6,))[0]
    engine.generate([Request("a", prompt_ids=prompt, max_new_tokens=2)])
    _, steps = run(engine, [prompt + [77, 78]], new=2)
    assert steps[0].rows.positions == list(range(8))
    assert steps[0].rows.computed_host == [0] * 8
    assert not engine.prefix_reuse and len(engine.prefix_cache) == 0
