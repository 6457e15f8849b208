"""Drive vLLM CPU (TP=2) through the sp_prefill workload; the arming comes from the
environment the test gives.

``python sp_prefill_run.py MODEL OUT.json [--tp N]``. Groups of requests are submitted
together and run to completion one after the other, so every prefill chunk has a known
row count: 64 (two requests in one chunk), 96, 20 (below the tests' min_rows of 32),
33 (odd: not divisible by TP 2), then 64 and 96 again (shapes already proven). Greedy,
four tokens each, with the sampled token's logprob. vLLM's spawned processes re-import
``__main__``, hence the guard.
"""

from __future__ import annotations

import argparse
import json
import os
import random

GROUPS = [{"a": 40, "b": 24}, {"c": 96}, {"d": 20}, {"e": 33}, {"f": 64}, {"g": 96}]
MAX_TOKENS = 4


def prompts(vocab: int = 512, seed: int = 3) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    return [{name: [rng.randrange(3, vocab) for _ in range(n)] for name, n in group.items()}
            for group in GROUPS]


def make_llm(model: str, tp: int):
    from pathlib import Path

    import torch
    from vllm import LLM

    # CPU attention (and AMX MLA) page in multiples of 32 tokens; CPU MLA without AMX in 16.
    mla = "kv_lora_rank" in json.loads((Path(model) / "config.json").read_text())
    block_size = 16 if mla and not torch.cpu._is_amx_tile_supported() else 32
    return LLM(model=model, tensor_parallel_size=tp, block_size=block_size,
               gpu_memory_utilization=0.25, enforce_eager=True, max_model_len=256,
               max_num_batched_tokens=128, max_num_seqs=8, enable_prefix_caching=False,
               seed=0)


def run(engine, groups: list[dict[str, list[int]]]) -> dict[str, dict]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                            logprobs=0)
    done: dict[str, dict] = {}
    for group in groups:
        for name, ids in group.items():
            engine.add_request(name, {"prompt_token_ids": ids}, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    result = out.outputs[0]
                    done[out.request_id] = {
                        "tokens": list(result.token_ids),
                        "logprobs": [lp[t].logprob for t, lp in
                                     zip(result.token_ids, result.logprobs)]}
    return done


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    engine = make_llm(args.model, args.tp).llm_engine
    with open(args.out, "w") as f:
        json.dump({"requests": run(engine, prompts())}, f)


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    main()
