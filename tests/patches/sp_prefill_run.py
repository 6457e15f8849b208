"""Drive vLLM CPU (TP=2) through the sp_prefill workload; the arming comes from the
environment the test gives.

``python sp_prefill_run.py MODEL OUT.json [--tp N]``. Groups of requests are submitted
together and run to completion one after the other, so every prefill chunk has a known
row count: 64 (two requests in one chunk), 96, 20 (below the tests' min_rows of 32),
33 (odd: not divisible by TP 2), then 64 and 96 again (shapes already proven). Greedy,
four tokens each, with the sampled token's logprob (:mod:`vllm_child`).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # tests/: vllm_child

from vllm_child import add, arguments, child_main, finish, make_llm, paged_block_size, write_json  # noqa: E402

GROUPS = [{"a": 40, "b": 24}, {"c": 96}, {"d": 20}, {"e": 33}, {"f": 64}, {"g": 96}]
MAX_TOKENS = 4


def prompts(vocab: int = 512, seed: int = 3) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)  # one generator across the groups
    return [{name: [rng.randrange(3, vocab) for _ in range(n)] for name, n in group.items()}
            for group in GROUPS]


def _result(out) -> dict:
    result = out.outputs[0]
    return {"tokens": list(result.token_ids),
            "logprobs": [lp[t].logprob for t, lp in zip(result.token_ids, result.logprobs)]}


def run(engine, groups: list[dict[str, list[int]]]) -> dict[str, dict]:
    done: dict[str, dict] = {}
    for group in groups:
        for name, ids in group.items():
            add(engine, name, ids, MAX_TOKENS, logprobs=0)
        finish(engine, done, _result)
    return done


def main() -> None:
    args = arguments(tp=2).parse_args()
    engine = make_llm(args.model, args.tp, block_size=paged_block_size(args.model),
                      max_model_len=256, max_num_batched_tokens=128,
                      enable_prefix_caching=False).llm_engine
    write_json(args.out, {"requests": run(engine, prompts())})


if __name__ == "__main__":
    child_main(main)
