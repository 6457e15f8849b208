"""Drive vLLM CPU in-process through a small fixed workload for capture tests.

``python vllm_capture_run.py MODEL OUT.json [--tp N]``; the arming (capture or none) comes
from the environment the test gives. Requests ``a`` (70 tokens) and ``b`` (23) start
together, ``c`` (9) joins two steps later (mixed steps), then ``a2`` repeats ``a``'s prompt
(a prefix-cache hit); greedy, a handful of decode steps each. vLLM's spawned processes
re-import ``__main__``, hence the guard.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

LENGTHS = {"a": 70, "b": 23, "c": 9}
MAX_TOKENS = {"a": 6, "b": 5, "c": 4, "a2": 4}


def prompts(vocab: int = 512, seed: int = 1) -> dict[str, list[int]]:
    rng = random.Random(seed)
    out = {name: [rng.randrange(3, vocab) for _ in range(n)] for name, n in LENGTHS.items()}
    out["a2"] = list(out["a"])
    return out


def make_llm(model: str, tp: int, ssm_dtype: str = "auto"):
    import torch
    from vllm import LLM

    # CPU attention (and AMX MLA) page in multiples of 32 tokens; CPU MLA, which runs
    # where the CPU lacks AMX, only in pages of 16.
    mla = "kv_lora_rank" in json.loads((Path(model) / "config.json").read_text())
    block_size = 16 if mla and not torch.cpu._is_amx_tile_supported() else 32
    return LLM(model=model, tensor_parallel_size=tp, block_size=block_size,
               gpu_memory_utilization=0.25, enforce_eager=True, max_model_len=256,
               max_num_batched_tokens=64, max_num_seqs=8, enable_prefix_caching=True,
               enable_chunked_prefill=True, seed=0, mamba_ssm_cache_dtype=ssm_dtype)


def run(model: str, tp: int, ssm_dtype: str = "auto") -> dict[str, dict]:
    from vllm import SamplingParams

    engine = make_llm(model, tp, ssm_dtype).llm_engine
    texts = prompts()
    done: dict[str, dict] = {}

    def add(name: str) -> None:
        params = SamplingParams(max_tokens=MAX_TOKENS[name], temperature=0.0, ignore_eos=True)
        engine.add_request(name, {"prompt_token_ids": texts[name]}, params)

    def step() -> None:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = {"output": list(out.outputs[0].token_ids),
                                        "cached_tokens": out.num_cached_tokens}

    add("a")
    add("b")
    step()
    step()
    add("c")
    while engine.has_unfinished_requests():
        step()
    add("a2")
    while engine.has_unfinished_requests():
        step()
    return done


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--hide-amx", action="store_true",
                        help="make vLLM believe the CPU lacks AMX (TP=1, in-process only): "
                             "it then takes the kernels an AMD AVX-512 machine runs")
    parser.add_argument("--ssm-dtype", default="auto",
                        help="vLLM's mamba_ssm_cache_dtype (the gated-delta state pool's dtype: "
                             "auto keeps the model's on CPUs without AVX-512 BF16, float32 on "
                             "the others)")
    args = parser.parse_args()
    if args.hide_amx:
        import torch

        torch.cpu._is_amx_tile_supported = lambda: False
    requests = run(args.model, args.tp, args.ssm_dtype)
    with open(args.out, "w") as f:
        json.dump({"requests": requests}, f)


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    main()
